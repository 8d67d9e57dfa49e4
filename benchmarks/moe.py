"""Routed experts on the GPU: the whole expert MLP (gate/up, activation, down, routing weights,
combine) through each implementation, and the grouped-matmul kernels alone.

    python benchmarks/moe.py            # on the H200 (tokamax column when it imports)
    python benchmarks/moe.py --small    # CPU smoke run (interpret mode, tiny shapes)
    python benchmarks/moe.py --sweep    # also sweep the Pallas kernel's tile settings

Uniform random top-k routing. Decode sizes report TB/s over the distinct experts touched (the
bytes that must move: each touched expert's three matrices once) against 4.3 TB/s; prefill sizes
report TFLOP/s against 790. Variants:
  pallas  our row-tiled kernels (`gmm=pallas`, the GPU default): grouped_glu + grouped_matmul
  mgpu    JAX's Hopper Mosaic GPU ragged_dot (three calls)
  xla     lax.ragged_dot (three calls; decode sizes only: it densifies)
  gather  per-token gathered expert weights (the old decode path; decode sizes only)
  tokamax tokamax.ragged_dot (Mosaic GPU), gate/up fused into one [E, D, 2F] weight
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
from k3jax.layers.activation import Activation  # noqa: E402
from k3jax.layers.moe_experts import (experts_dense, experts_gather, experts_ragged, sort_by_expert,  # noqa: E402
                                      unsort_and_sum)
from pallas_kernels.moe_gmm import TileBlocks, grouped_glu_pallas, grouped_matmul_pallas  # noqa: E402

MODELS = {"kimi-linear": (256, 2304, 1024, 8), "k3-latent": (896, 3584, 3072, 16)}  # E, D, F, top-k
SWEEP = [TileBlocks(16, n, k, w, s) for n in (32, 64, 128) for k in (128, 256) for w in (4,) for s in (3, 4)]


def tokamax_variant():
    """The routed-expert MLP through tokamax.ragged_dot, or None when tokamax does not import."""
    try:
        import tokamax  # noqa: PLC0415 - optional peer, brought along as a wheel on the GPU machine
    except Exception as e:  # noqa: BLE001
        print(f"tokamax not available: {type(e).__name__}: {e}", flush=True)
        return None

    def run(x, weights, experts, w13, w2):
        _, k = experts.shape
        order, sizes, _ = sort_by_expert(experts, w13.shape[0])
        xs = x[order // k]
        h = tokamax.ragged_dot(xs, w13, sizes, fuse_gateup_activation="silu")
        y = tokamax.ragged_dot(h, w2, sizes).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return unsort_and_sum(y, order, k)          # as the model combines the pairs
    return run


def case(e, d, f, k, tokens, seed=0):
    rng = np.random.default_rng(seed + tokens)
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    x = jax.random.normal(jax.random.key(tokens), (tokens, d), jnp.bfloat16)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, k)), jnp.float32)
    return x, weights, jnp.asarray(experts), int(len(np.unique(experts)))


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--models", nargs="*", default=None)
    args = ap.parse_args(argv)
    models = {"tiny": (8, 64, 32, 2)} if args.small else {m: MODELS[m] for m in (args.models or MODELS)}
    decode_tokens = [1, 8] if args.small else [1, 8, 64, 256]
    prefill_tokens = [64] if args.small else [4096]
    act = Activation("silu")
    tok = None if args.small else tokamax_variant()
    rows, sweep_rows = [], []
    for model, (e, d, f, k) in models.items():
        keys = jax.random.split(jax.random.key(e), 3)
        w1, w3 = (jax.random.normal(kk, (e, d, f), jnp.bfloat16) * 0.02 for kk in keys[:2])
        w2 = jax.random.normal(keys[2], (e, f, d), jnp.bfloat16) * 0.02
        w13 = jnp.concatenate([w1, w3], axis=2) if tok is not None else None
        for tokens in decode_tokens + prefill_tokens:
            x, weights, experts, touched = case(e, d, f, k, tokens)
            decode = tokens in decode_tokens
            m = tokens * k
            row = {"model": model, "tokens": tokens, "rows": m, "experts_touched": touched,
                   "phase": "decode" if decode else "prefill"}
            variants = {"pallas": jax.jit(lambda *a: experts_ragged(*a, act, gmm="pallas")),
                        "mgpu": jax.jit(lambda *a: experts_ragged(*a, act, gmm="mgpu"))}
            if decode:
                variants["xla"] = jax.jit(lambda *a: experts_ragged(*a, act, gmm="xla"))
                variants["gather"] = jax.jit(lambda *a: experts_gather(*a, act))
            expect = None
            if args.small:
                expect = experts_dense(x, weights, experts, w1, w3, w2, act)
            for name, fn in variants.items():
                try:
                    t, _ = median_time(lambda: fn(x, weights, experts, w1, w3, w2), iters=args.iters)
                    out = fn(x, weights, experts, w1, w3, w2)
                    if expect is None:
                        expect = out
                    row[f"{name}_ms"] = t * 1e3
                    row[f"{name}_err"] = rel(out, expect)
                except Exception as exc:  # noqa: BLE001 - e.g. XLA's dense fallback out of memory
                    row[f"{name}_ms"] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
            if tok is not None:
                fn = jax.jit(tok)
                try:
                    t, _ = median_time(lambda: fn(x, weights, experts, w13, w2), iters=args.iters)
                    row["tokamax_ms"] = t * 1e3
                    row["tokamax_err"] = rel(fn(x, weights, experts, w13, w2), expect)
                except Exception as exc:  # noqa: BLE001
                    row["tokamax_ms"] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
            # The two Pallas kernels alone (rows already sorted): glu reads w1 and w3, down reads w2.
            order, sizes, _ = sort_by_expert(experts, e)
            xs = x[order // k]
            glu = jax.jit(grouped_glu_pallas)   # weights are arguments: never captured as constants
            down = jax.jit(grouped_matmul_pallas)
            h = glu(xs, w1, w3, sizes)
            t_glu, _ = median_time(lambda: glu(xs, w1, w3, sizes), iters=args.iters)
            t_down, _ = median_time(lambda: down(h, w2, sizes), iters=args.iters)
            row.update(pallas_glu_ms=t_glu * 1e3, pallas_down_ms=t_down * 1e3)
            w_bytes = touched * d * f * 2
            row["pallas_glu_pct_4.3TB_s"] = 2 * w_bytes / t_glu / HBM_ACHIEVABLE * 100
            row["pallas_down_pct_4.3TB_s"] = w_bytes / t_down / HBM_ACHIEVABLE * 100
            best = min((v for key, v in row.items() if key.endswith("_ms") and "_glu" not in key
                        and "_down" not in key and isinstance(v, float)), default=None)
            nbytes = 3 * w_bytes + m * (2 * d + 2 * f) * 2
            for key in [kk for kk in row if kk.endswith("_ms") and isinstance(row[kk], float)]:
                if "_glu" in key or "_down" in key:
                    continue
                name = key[:-3]
                if decode:
                    row[f"{name}_pct_4.3TB_s"] = nbytes / (row[key] / 1e3) / HBM_ACHIEVABLE * 100
                else:
                    row[f"{name}_TFLOP_s"] = 6 * m * d * f / (row[key] / 1e3) / 1e12
                    row[f"{name}_pct_790TF"] = row[f"{name}_TFLOP_s"] * 1e12 / BF16_ACHIEVABLE * 100
            row["floor_ms"] = nbytes / HBM_ACHIEVABLE * 1e3 if decode else 6 * m * d * f / BF16_ACHIEVABLE * 1e3
            row["best_ms"] = best
            if args.sweep and model == "kimi-linear" and tokens in (1, 64, 256):
                for blocks in SWEEP:
                    fn = jax.jit(lambda a, g, u, s, blocks=blocks: grouped_glu_pallas(a, g, u, s, blocks=blocks))
                    try:
                        t, _ = median_time(lambda: fn(xs, w1, w3, sizes), iters=args.iters)
                        sweep_rows.append({"tokens": tokens, **vars(blocks), "glu_ms": t * 1e3,
                                           "pct_4.3TB_s": 2 * w_bytes / t / HBM_ACHIEVABLE * 100})
                    except Exception as exc:  # noqa: BLE001
                        sweep_rows.append({"tokens": tokens, **vars(blocks), "glu_ms": f"failed: {type(exc).__name__}"})
            rows.append(row)
            print({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
    record = {"benchmark": "moe", "env": environment(), "rows": rows, "sweep": sweep_rows}
    path = write("moe" + ("_small" if args.small else ""), record)
    cols = ["model", "phase", "tokens", "experts_touched", "floor_ms", "pallas_ms", "mgpu_ms", "xla_ms", "gather_ms",
            "tokamax_ms", "pallas_pct_4.3TB_s", "pallas_TFLOP_s", "pallas_glu_pct_4.3TB_s", "pallas_down_pct_4.3TB_s"]
    print(table(rows, cols))
    if sweep_rows:
        print(table(sorted(sweep_rows, key=lambda r: (r["tokens"], str(r["glu_ms"]))),
                    ["tokens", "block_n", "block_k", "num_stages", "glu_ms", "pct_4.3TB_s"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
