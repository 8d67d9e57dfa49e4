"""One process per GPU under jax.distributed against one process owning every GPU (issue 20).

    python benchmarks/multiprocess_gpu.py            # on nvidia-h200-x2: 2 processes x 1 GPU vs 1 x 2
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/multiprocess_gpu.py  # smoke

The tiny Kimi-Linear model with random weights, experts over an expert=N mesh (N = the local GPUs),
both expert dispatches: logits of a fixed batch and 8 greedy tokens (full forwards of the growing
sequence: `generate`'s loop runs in one process) from one process owning all N GPUs, then from N processes with one GPU each (this script re-run as workers, coordinator on
127.0.0.1). Prints the largest logit difference and whether the tokens are equal; exit status 1 if
they differ. NCCL_NVLS_ENABLE stays as the machine sets it (0).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEED, BATCH, PROMPT, NEW = 13, 4, 12, 8


def run(mesh_devices: int, dispatch: str) -> dict:
    """Logits and greedy tokens of the tiny model over an expert mesh of the visible devices."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import k3jax
    from k3jax.sharding import MeshSpec, make_mesh

    mesh = make_mesh(MeshSpec(expert=mesh_devices))
    cfg = k3jax.tiny_kimi_linear().with_impls(ep_dispatch=dispatch)
    model = k3jax.CausalLM.random(cfg, seed=SEED, mesh=mesh)
    ids = np.random.default_rng(0).integers(3, 500, (BATCH, PROMPT))
    logits = multihost_utils.process_allgather(model.logits(ids), tiled=True)
    # Greedy tokens by full forwards of the growing sequence (the generate loop is single-process).
    seqs = ids
    for _ in range(NEW):
        last = multihost_utils.process_allgather(model.logits(seqs), tiled=True)
        seqs = np.concatenate([seqs, np.argmax(np.asarray(last)[:, -1], axis=-1)[:, None]], axis=1)
    tokens = seqs[:, PROMPT:].tolist()
    return {"logits": np.asarray(logits, np.float32).tolist(), "tokens": tokens}


def worker(process_id: int, processes: int, port: int, dispatch: str, out: str) -> None:
    import jax

    on_cpu = os.environ.get("JAX_PLATFORMS") == "cpu"       # the CPU smoke run: one CPU device per process
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                               process_id=process_id, local_device_ids=None if on_cpu else [process_id])
    result = run(processes, dispatch)
    if process_id == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    jax.distributed.shutdown()


def main() -> int:
    if len(sys.argv) > 1:                       # a worker: PROCESS_ID PROCESSES PORT DISPATCH OUT
        worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return 0
    import jax
    import numpy as np

    gpus = len(jax.devices())
    ok = True
    for dispatch in ("gather", "ragged"):
        single = run(gpus, dispatch)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = f"/tmp/multiprocess_{dispatch}.json"
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(i), str(gpus), str(port), dispatch,
                                   out], env=env) for i in range(gpus)]
        codes = [p.wait(timeout=500) for p in procs]
        if any(codes):
            print(f"{dispatch}: worker exit codes {codes}", flush=True)
            ok = False
            continue
        with open(out) as f:
            multi = json.load(f)
        diff = float(np.max(np.abs(np.asarray(multi["logits"]) - np.asarray(single["logits"]))))
        same = multi["tokens"] == single["tokens"]
        ok = ok and same and diff < 1e-4
        print(f"{dispatch}: {gpus} processes x 1 GPU vs 1 process x {gpus} GPUs: max |logit diff| {diff:.3g}, "
              f"greedy tokens equal: {same}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
