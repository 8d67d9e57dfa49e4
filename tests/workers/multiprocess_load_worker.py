"""One process of the two-process loading tests: 2 CPU devices each, 4 in all.

    python tests/workers/multiprocess_load_worker.py PROCESS_ID PORT OUT_DIR \
        LABEL=CHECKPOINT@MESH[@packed] ...

Loads each checkpoint (Hugging Face or converted; `@packed`: MXFP4 experts kept packed) onto its
mesh ('expert=4', 'tensor=4', ...) in turn and writes, under OUT_DIR, the bytes this process read
for it (`read_LABEL_PROCESS.json`) and, from process 0, the logits of a fixed batch
(`logits_LABEL.npy`).
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
process_id, port, out_dir, jobs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import k3jax  # noqa: E402
from k3jax.sharding import MeshSpec, make_mesh  # noqa: E402

for job in jobs:
    label, rest = job.split("=", 1)
    checkpoint, mesh, *packed = rest.rsplit("@", 2) if rest.endswith("@packed") else rest.rsplit("@", 1)
    model = k3jax.load(checkpoint, mesh=make_mesh(MeshSpec.parse(mesh)), dtype="float32", packed_experts=bool(packed))
    ids = np.random.default_rng(0).integers(3, min(512, model.config.vocab_size), (4, 10))
    with open(os.path.join(out_dir, f"read_{label}_{process_id}.json"), "w") as f:
        json.dump({"bytes_read": model.load_report.bytes_read, "tensors": model.load_report.tensors}, f)
    logits = multihost_utils.process_allgather(model.logits(ids), tiled=True)
    if process_id == 0:
        np.save(os.path.join(out_dir, f"logits_{label}.npy"), np.asarray(logits))
    multihost_utils.sync_global_devices(f"done {label}")
jax.distributed.shutdown()
