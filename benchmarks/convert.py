"""Converter memory and throughput on a generated checkpoint (CPU; no GPU needed).

    python benchmarks/convert.py [--experts 160] [--workers 1 4]

Writes a Kimi-Linear-shaped checkpoint of random bf16 weights (hidden 512, 4 layers, many 512x1024
experts; about 1.5 GB at 160 experts) with k3jax's writer, converts it in a child process per
setting, and reports the child's peak RSS, MB/s and the files it wrote next to the largest single tensor.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, table, write  # noqa: E402


def build(path: str, experts: int) -> None:
    import k3jax
    from k3jax.checkpoint.writer import save_checkpoint

    cfg = k3jax.tiny_kimi_linear(hidden=512, num_experts=experts, expert_intermediate_size=1024)
    save_checkpoint(k3jax.CausalLM.random(cfg, seed=0, dtype="bfloat16"), path, shards=4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=160)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); "
                        f"from benchmarks.convert import build; build({src!r}, {args.experts})"], check=True)
        from k3jax.checkpoint.safetensors_io import SafetensorsCheckpoint
        ckpt = SafetensorsCheckpoint(src)
        size, largest = ckpt.total_bytes, max(t.nbytes for t in ckpt.tensors.values())
        rows = []
        for workers in args.workers:
            dst = os.path.join(tmp, f"dst{workers}")
            probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
                     "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "convert", src, dst, "--quiet",
                                  "--workers", str(workers)], capture_output=True, text=True, check=True, cwd=root,
                                 env={**os.environ, "PYTHONPATH": root})
            seconds = time.perf_counter() - t0
            peak = int(out.stdout.strip().splitlines()[-1]) * 1024
            files = sum(len(names) for _, _, names in os.walk(dst))
            rows.append({"source_mb": size / 1e6, "tensors": len(ckpt.tensors), "largest_tensor_mb": largest / 1e6,
                         "workers": workers, "files": files, "peak_rss_mb": peak / 1e6, "seconds_with_startup": seconds,
                         "converter_line": out.stdout.strip().splitlines()[-2]})
            print(rows[-1], flush=True)
    record = {"benchmark": "convert", "env": environment(), "rows": rows}
    path = write("convert", record)
    print(table(rows, ["source_mb", "tensors", "largest_tensor_mb", "workers", "files", "peak_rss_mb",
                       "seconds_with_startup"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
