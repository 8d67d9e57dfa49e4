"""What each process reads when a checkpoint loads over two `jax.distributed` processes, and how long
it takes: both formats (Hugging Face safetensors and converted), onto data=2 (every process holds
everything), expert=2 and tensor=2 meshes of one CPU device per process.

    python benchmarks/multiprocess_read.py                  # about 3.3 GB of bf16 (CPU, a few minutes)
    python benchmarks/multiprocess_read.py --experts 8      # smaller

The model is Kimi-Linear-48B's first four layers (3 KDA + 1 MLA, layer 0 dense) at its real widths,
with `--experts` routed experts a layer instead of 256, written as random bf16 safetensors
(`checkpoint_read.write_source`) and converted. Each load runs in two fresh processes started
together; each reports `load_report.bytes_read` (tensor bytes for safetensors, tensorstore's file
bytes for the converted checkpoint) and its load time (a barrier, then `k3jax.load` until every
local array is ready). Files come from a warm page cache: the times are the readers' cost, not a
disk's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MESHES = ("data=2", "expert=2", "tensor=2")


def worker(process_id: int, port: int, checkpoint: str, mesh: str, out: str) -> None:
    """One process of a two-process load: writes {bytes_read, seconds} to `out`."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from flax import nnx
    from jax.experimental import multihost_utils

    import k3jax
    from k3jax.sharding import MeshSpec, make_mesh

    multihost_utils.sync_global_devices("start")
    start = time.perf_counter()
    model = k3jax.load(checkpoint, mesh=make_mesh(MeshSpec.parse(mesh)), dtype="bfloat16")
    jax.block_until_ready(jax.tree.leaves(nnx.state(model.module)))
    seconds = time.perf_counter() - start
    with open(out, "w") as f:
        json.dump({"bytes_read": model.load_report.bytes_read, "seconds": seconds}, f)
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


def two_process_load(checkpoint: str, mesh: str, tmp: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = [os.path.join(tmp, f"read_{i}.json") for i in range(2)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), str(port), checkpoint, mesh, outs[i]],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode for p in procs):
        tails = "\n---\n".join(log[-2000:] for log in logs)
        raise RuntimeError(f"a load process failed ({checkpoint} @ {mesh}):\n{tails}")
    reads = []
    for out in outs:
        with open(out) as f:
            reads.append(json.load(f))
    return reads


def config(experts: int):
    from k3jax.config import kimi_linear_48b_a3b

    cfg = kimi_linear_48b_a3b()
    return cfg.replace(mixers=("kda", "kda", "kda", "mla"), ffns=cfg.ffns[:4],
                       moe=dataclasses.replace(cfg.moe, num_experts=experts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32, help="routed experts a layer (the model has 256)")
    ap.add_argument("--formats", nargs="+", default=["safetensors", "converted"], choices=["safetensors", "converted"])
    ap.add_argument("--tmp", default=None, help="directory for the checkpoints (default: the system temp dir)")
    args = ap.parse_args(argv)
    from benchmarks.checkpoint_read import write_source
    from benchmarks.common import environment, table, write
    from k3jax.checkpoint.convert import convert

    cfg = config(args.experts)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        src, dst = os.path.join(tmp, "hf"), os.path.join(tmp, "converted")
        size = write_source(src, cfg)
        convert(src, dst, dtype="bfloat16", workers=2, progress=False)
        stored = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(os.path.join(dst, "params"))
                     for f in files)
        for fmt, path, total in (("safetensors", src, size), ("converted", dst, stored)):
            if fmt not in args.formats:
                continue
            for mesh in MESHES:
                two_process_load(path, mesh, tmp)               # warms the page cache and the imports
                reads = two_process_load(path, mesh, tmp)
                rows.append({"format": fmt, "mesh": mesh, "total_MB": round(total / 1e6, 1),
                             "read_MB_p0": round(reads[0]["bytes_read"] / 1e6, 1),
                             "read_MB_p1": round(reads[1]["bytes_read"] / 1e6, 1),
                             "share_p0": round(reads[0]["bytes_read"] / total, 3),
                             "share_p1": round(reads[1]["bytes_read"] / total, 3),
                             "seconds_p0": round(reads[0]["seconds"], 2), "seconds_p1": round(reads[1]["seconds"], 2)})
                print(rows[-1], flush=True)
    columns = ["format", "mesh", "total_MB", "read_MB_p0", "read_MB_p1", "share_p0", "share_p1", "seconds_p0",
               "seconds_p1"]
    print(table(rows, columns))
    path = write("multiprocess_read", {"environment": environment(), "experts": args.experts, "rows": rows})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
    else:
        sys.exit(main())
