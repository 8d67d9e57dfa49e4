"""Skinny matmuls of the decode step (a few rows times a projection weight) on the GPU: XLA's dot
beside the row-tiled Pallas kernel (`grouped_matmul_pallas` with one group).

    python benchmarks/gemv.py             # on the H200; XLA_FLAGS may be set to compare rewrites
    python benchmarks/gemv.py --small     # CPU smoke run

TB/s counts the weight (read once) plus activations against 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import HBM_ACHIEVABLE, environment, median_time, table, write  # noqa: E402
from pallas_kernels.moe_gmm import grouped_matmul_pallas  # noqa: E402

# (name, K, N): Kimi-Linear-48B decode projections.
SHAPES = [("kda q|k|v fused", 2304, 12288), ("kda q (one of three)", 2304, 4096), ("kda o_proj", 4096, 2304),
          ("mla q_proj", 2304, 6144), ("shared gate|up", 2304, 2048), ("lm_head", 2304, 163840)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--name", default="gemv")
    args = ap.parse_args(argv)
    shapes = [("tiny", 64, 128)] if args.small else SHAPES
    rows = []
    for name, k, n in shapes:
        w = jax.random.normal(jax.random.key(k + n), (k, n), jnp.bfloat16)
        for m in (1, 8, 64):
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            sizes = jnp.array([m], jnp.int32)
            xla = jax.jit(lambda a, b: a @ b)
            ours = jax.jit(lambda a, b, s: grouped_matmul_pallas(a, b[None], s))
            t_x, _ = median_time(lambda: xla(x, w), iters=args.iters)
            t_p, _ = median_time(lambda: ours(x, w, sizes), iters=args.iters)
            nbytes = (k * n + m * (k + n)) * 2
            rows.append({"shape": name, "M": m, "K": k, "N": n, "xla_us": t_x * 1e6, "pallas_us": t_p * 1e6,
                         "xla_pct_4.3TB_s": nbytes / t_x / HBM_ACHIEVABLE * 100,
                         "pallas_pct_4.3TB_s": nbytes / t_p / HBM_ACHIEVABLE * 100,
                         "max_abs_diff": float(jnp.max(jnp.abs(xla(x, w).astype(jnp.float32)
                                                               - ours(x, w, sizes).astype(jnp.float32))))})
            print(rows[-1], flush=True)
    record = {"benchmark": "gemv", "xla_flags": os.environ.get("XLA_FLAGS", ""), "env": environment(), "rows": rows}
    path = write(args.name + ("_small" if args.small else ""), record)
    print(table(rows, ["shape", "M", "xla_us", "pallas_us", "xla_pct_4.3TB_s", "pallas_pct_4.3TB_s"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
