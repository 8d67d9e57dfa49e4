"""One process of the two-process loading test: 2 CPU devices each, experts over all 4.

    python tests/workers/multiprocess_load_worker.py PROCESS_ID PORT CHECKPOINT OUT_DIR

Loads the Hugging Face checkpoint onto an expert=4 mesh, writes the bytes this process read (and,
from process 0, the logits of a fixed batch) under OUT_DIR.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
process_id, port, checkpoint, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import k3jax  # noqa: E402
from k3jax.sharding import MeshSpec, make_mesh  # noqa: E402

mesh = make_mesh(MeshSpec(expert=4))
model = k3jax.load(checkpoint, mesh=mesh, dtype="float32")
with open(os.path.join(out_dir, f"read_{process_id}.json"), "w") as f:
    json.dump({"bytes_read": model.load_report.bytes_read, "tensors": model.load_report.tensors}, f)
ids = np.random.default_rng(0).integers(3, 512, (4, 10))
logits = multihost_utils.process_allgather(model.logits(ids), tiled=True)
if process_id == 0:
    np.save(os.path.join(out_dir, "logits.npy"), np.asarray(logits))
multihost_utils.sync_global_devices("done")
jax.distributed.shutdown()
