"""One process of the two-process test: 2 CPU devices each, 4 global, a sharded forward.

    python tests/workers/multiprocess_worker.py PROCESS_ID PORT OUT_FILE
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
process_id, port, out_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import k3jax  # noqa: E402
from k3jax.sharding import MeshSpec, make_mesh  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 4, (jax.process_count(), jax.devices())
mesh = make_mesh(MeshSpec(data=2, expert=2))
model = k3jax.CausalLM.random(k3jax.tiny_kimi_linear(), seed=13, mesh=mesh)
ids = np.random.default_rng(0).integers(3, 512, (4, 10))
logits = multihost_utils.process_allgather(model.logits(ids), tiled=True)
if process_id == 0:
    np.save(out_file, np.asarray(logits))
multihost_utils.sync_global_devices("done")
jax.distributed.shutdown()
