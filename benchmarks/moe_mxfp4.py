"""Routed-expert kernels on MXFP4 weights kept packed, beside the same kernels on bf16 weights.

    python benchmarks/moe_mxfp4.py            # on the H200: Kimi-Linear and K3-latent expert shapes
    python benchmarks/moe_mxfp4.py --small    # CPU smoke run (interpret mode)

Uniform random top-k routing. Decode sizes (1, 8 tokens) run the unsorted pair kernels, larger ones
the grouped kernels over rows sorted by expert. `pct` = bytes of the touched experts' gate, up and
down weights (packed: half a byte per value plus one scale byte per 32) over the time, against
4.3 TB/s; outputs are checked against the bf16 kernels on the dequantised weights.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import HBM_ACHIEVABLE, chained_time, environment, table, write  # noqa: E402
from k3jax.layers.moe_experts import sort_by_expert  # noqa: E402
from pallas_kernels.moe_gmm import (grouped_glu_pallas, grouped_matmul_pallas, pair_glu_pallas,  # noqa: E402
                                    pair_matmul_pallas)
from pallas_kernels.moe_gmm.mxfp4 import Mxfp4Weight, dequantize  # noqa: E402

MODELS = {"kimi-linear": (256, 2304, 1024, 8), "k3-latent": (896, 3584, 3072, 16)}  # E, D, F, top-k


def packed(rng, e, k, n) -> Mxfp4Weight:
    """Random codes with scales near 2^-6 (weights of about 0.02)."""
    return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (e, k // 2, n), dtype=np.uint8)),
                       jnp.asarray(rng.integers(118, 123, (e, k // 32, n), dtype=np.uint8)))


def experts_mlp(x, weights, experts, w1, w3, w2):
    """The routed-expert MLP through the Pallas kernels: pairs for a few tokens, sorted rows above."""
    n, k = experts.shape
    if n <= 8:
        group, valid = experts.reshape(-1), jnp.ones((n * k,), bool)
        h = pair_glu_pallas(x, w1, w3, group, valid, repeat=k)
        y = pair_matmul_pallas(h, w2, group, valid, weights.reshape(-1))
        return y.reshape(n, k, -1).sum(axis=1)
    order, sizes, _ = sort_by_expert(experts, w1.shape[0])
    h = grouped_glu_pallas(x[order // k], w1, w3, sizes)
    y = grouped_matmul_pallas(h, w2, sizes, weights.reshape(-1)[order])
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[order // k].add(y)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--tokens", nargs="*", type=int, default=None)
    args = ap.parse_args(argv)
    models = {"tiny": (8, 64, 32, 2)} if args.small else {m: MODELS[m] for m in (args.models or MODELS)}
    token_counts = args.tokens or ([1, 16] if args.small else [1, 8, 64, 256, 4096])
    rows = []
    for model, (e, d, f, k) in models.items():
        rng = np.random.default_rng(e)
        q1, q3, q2 = packed(rng, e, d, f), packed(rng, e, d, f), packed(rng, e, f, d)
        b1, b3, b2 = (dequantize(w) for w in (q1, q3, q2))
        for tokens in token_counts:
            experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]), jnp.int32)
            x = jax.random.normal(jax.random.key(tokens), (tokens, d), jnp.bfloat16)
            weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, k)), jnp.float32)
            touched = len(np.unique(np.asarray(experts)))
            row = {"model": model, "tokens": tokens, "experts_touched": touched}
            out = {}
            for name, ws in (("bf16", (b1, b3, b2)), ("mxfp4", (q1, q3, q2))):
                out[name] = jax.jit(experts_mlp)(x, weights, experts, *ws)
                t = chained_time(experts_mlp, (x, weights, experts, *ws), reps=5 if args.small else 20,
                                 iters=2 if args.small else 10)
                per_value = 2 if name == "bf16" else 0.5 + 1 / 32
                nbytes = 3 * touched * d * f * per_value
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_pct_4.3TB_s"] = nbytes / t / HBM_ACHIEVABLE * 100
            a, b = (np.asarray(out[n], np.float64) for n in ("mxfp4", "bf16"))
            row["speedup"] = row["bf16_ms"] / row["mxfp4_ms"]
            row["err_vs_bf16"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
            rows.append(row)
            print({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
    record = {"benchmark": "moe_mxfp4", "env": environment(), "rows": rows}
    path = write("moe_mxfp4" + ("_small" if args.small else ""), record)
    print(table(rows, ["model", "tokens", "experts_touched", "bf16_ms", "mxfp4_ms", "speedup", "bf16_pct_4.3TB_s",
                       "mxfp4_pct_4.3TB_s", "err_vs_bf16"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
