"""Grouped expert GEMM on the GPU: JAX's Hopper Mosaic GPU kernel beside `lax.ragged_dot`.

    python benchmarks/moe.py            # on the H200
    python benchmarks/moe.py --small    # CPU smoke run (GPU-interpret mode, tiny shapes)

One grouped matmul lhs [M, D] x experts [E, D, F] with M = tokens x top-k rows sorted by a
uniform random routing. Decode shapes report GB/s over the distinct experts touched (the bytes
that must move) against 4.3 TB/s; prefill shapes report TFLOP/s against 790.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import BF16_ACHIEVABLE, HBM_ACHIEVABLE, environment, median_time, table, write  # noqa: E402
from pallas_kernels.moe_gmm import GmmBlocks, grouped_matmul  # noqa: E402

MODELS = {"kimi-linear": (256, 2304, 1024, 8), "k3-latent": (896, 3584, 3072, 16)}  # E, D, F, top-k


def case(e, d, f, k, tokens, seed=0):
    rng = np.random.default_rng(seed + tokens)
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]).reshape(-1)
    sizes = np.bincount(experts, minlength=e).astype(np.int32)
    lhs = jax.random.normal(jax.random.key(tokens), (tokens * k, d), jnp.bfloat16)
    return lhs, jnp.asarray(sizes), int((sizes > 0).sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    models = {"tiny": (8, 128, 128, 2)} if args.small else MODELS
    decode_tokens = [1, 8] if args.small else [1, 8, 64, 256]
    prefill_tokens = [64] if args.small else [4096]
    variants = {"mgpu": GmmBlocks()} if not args.small else {
        "mgpu": GmmBlocks(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2)}
    rows = []
    for model, (e, d, f, k) in models.items():
        rhs = jax.random.normal(jax.random.key(e), (e, d, f), jnp.bfloat16)
        for tokens in decode_tokens + prefill_tokens:
            lhs, sizes, touched = case(e, d, f, k, tokens)
            m = tokens * k
            row = {"model": model, "tokens": tokens, "rows": m, "experts_touched": touched,
                   "phase": "decode" if tokens in decode_tokens else "prefill"}
            ref = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, impl="xla"))
            try:
                t_x, _ = median_time(lambda: ref(lhs, rhs, sizes), iters=args.iters)
                row["xla_ms"] = t_x * 1e3
                expect = ref(lhs, rhs, sizes)
            except Exception as exc:  # noqa: BLE001 - XLA's dense fallback runs out of memory at large M
                row["xla_ms"] = f"failed: {type(exc).__name__}"
                expect = None
            for name, blocks in variants.items():
                fn = jax.jit(lambda a, b, s, blocks=blocks: grouped_matmul(a, b, s, impl="mgpu", blocks=blocks))
                try:
                    t, _ = median_time(lambda: fn(lhs, rhs, sizes), iters=args.iters)
                except Exception as exc:  # noqa: BLE001
                    row[f"{name}_ms"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                    continue
                row[f"{name}_ms"] = t * 1e3
                if expect is not None:
                    out = fn(lhs, rhs, sizes)
                    row[f"{name}_err"] = float(jnp.linalg.norm((out - expect).astype(jnp.float32))
                                               / jnp.linalg.norm(expect.astype(jnp.float32)))
            best = min((v for key, v in row.items() if key.endswith("_ms") and isinstance(v, float)), default=None)
            if best is not None:
                nbytes = touched * d * f * 2 + m * (d + f) * 2
                row["best_ms"] = best
                row["TB_s"] = nbytes / (best / 1e3) / 1e12
                row["pct_4.3TB_s"] = row["TB_s"] * 1e12 / HBM_ACHIEVABLE * 100
                row["TFLOP_s"] = 2 * m * d * f / (best / 1e3) / 1e12
                row["pct_790TF"] = row["TFLOP_s"] * 1e12 / BF16_ACHIEVABLE * 100
            rows.append(row)
            print({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
    record = {"benchmark": "moe_gmm", "env": environment(), "rows": rows}
    path = write("moe" + ("_small" if args.small else ""), record)
    print(table(rows, ["model", "phase", "tokens", "experts_touched", "xla_ms", "mgpu_ms", "TB_s",
                       "pct_4.3TB_s", "TFLOP_s", "pct_790TF"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
