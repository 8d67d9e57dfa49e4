"""The decode-time routed-expert launches of the Kimi-Linear-48B shape (B=1: 8 routed pairs plus the
shared expert as a ninth, `pallas_kernels.moe_gmm.pair_glu` / `pair_matmul`) under several tile
settings (`TileBlocks`): how the programs of one launch fill the 132 SMs.

    python benchmarks/pair_tiles.py            # on the H200
    python benchmarks/pair_tiles.py --small    # CPU smoke run (interpret mode, tiny shapes)

Time per launch: REPS launches unrolled in one compiled program (`benchmarks/skinny.py: chain_time`),
each on other experts (and one of four shared experts) so the weights come from HBM, not the 50 MB
L2; minus the chain's own cost. TB/s counts the weights of the pairs once against 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import skinny  # noqa: E402
from benchmarks.common import HBM_ACHIEVABLE, environment, table, write  # noqa: E402
from pallas_kernels.moe_gmm.kernel import pair_glu_pallas, pair_matmul_pallas  # noqa: E402
from pallas_kernels.moe_gmm.tuning import TileBlocks  # noqa: E402

SHAPE = {"experts": 256, "top_k": 8, "hidden": 2304, "inter": 1024, "shared": 4}
SMALL = {"experts": 16, "top_k": 2, "hidden": 128, "inter": 64, "shared": 2}
GLU_TILES = {"16x64x128 w4 s4 (default)": TileBlocks(16, 64, 128, 4, 4),
             "16x128x64 w4 s4": TileBlocks(16, 128, 64, 4, 4),
             "16x128x128 w4 s3": TileBlocks(16, 128, 128, 4, 3), "16x128x128 w8 s3": TileBlocks(16, 128, 128, 8, 3),
             "16x64x256 w4 s3": TileBlocks(16, 64, 256, 4, 3), "16x64x128 w4 s2": TileBlocks(16, 64, 128, 4, 2),
             "16x32x256 w4 s4": TileBlocks(16, 32, 256, 4, 4)}
DOWN_TILES = {"16x64x128 w4 s4 (default)": TileBlocks(16, 64, 128, 4, 4),
              "16x128x128 w4 s4": TileBlocks(16, 128, 128, 4, 4),
              "16x128x64 w4 s4": TileBlocks(16, 128, 64, 4, 4), "16x32x256 w4 s4": TileBlocks(16, 32, 256, 4, 4),
              "16x64x256 w4 s3": TileBlocks(16, 64, 256, 4, 3), "16x256x64 w8 s3": TileBlocks(16, 256, 64, 8, 3),
              "16x64x64 w4 s4": TileBlocks(16, 64, 64, 4, 4)}
REPS = 30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)
    s = SMALL if args.small else SHAPE
    if args.small:
        skinny.REPS = 3
    e, k, d, f, n_shared = s["experts"], s["top_k"], s["hidden"], s["inter"], s["shared"]
    key = jax.random.key(0)
    w = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) * 0.02
    w1, w3, w2 = w(1, (e, d, f)), w(2, (e, d, f)), w(3, (e, f, d))
    s1, s3, s2 = w(4, (n_shared, d, f)), w(5, (n_shared, d, f)), w(6, (n_shared, f, d))
    x = w(7, (1, d)) * 50
    h = w(8, (k + 1, f)) * 50
    scale = jnp.ones((k + 1,), jnp.float32)
    groups = [jnp.concatenate([(r * k + jnp.arange(k)) % e, jnp.array([e + r % n_shared])]).astype(jnp.int32)
              for r in range(skinny.REPS)]
    rows = []
    base = skinny.chain_time(lambda x0: jnp.sum(x0[:, :1].astype(jnp.float32)), (x,))
    print(f"chain overhead per launch {base * 1e6:.2f} us (subtracted)", flush=True)
    for what, tiles, nbytes in (("gate|up", GLU_TILES, 2 * d * f * 2), ("down", DOWN_TILES, d * f * 2)):
        for pairs in (k, k + 1):
            for label, blocks in tiles.items():
                counter = iter(range(10 ** 9))

                def launch(lhs, *weights, blocks=blocks, pairs=pairs, what=what):
                    r = next(counter) % skinny.REPS
                    group, valid = groups[r][:pairs], jnp.ones((pairs,), bool)
                    extra_on = pairs > k
                    if what == "gate|up":
                        a, b, sa, sb = weights
                        out = pair_glu_pallas(lhs, a, b, group, valid, repeat=pairs, blocks=blocks,
                                              extra=(sa, sb) if extra_on else None)
                    else:
                        c, sc = weights
                        out = pair_matmul_pallas(lhs[:pairs], c, group, valid, scale[:pairs], blocks=blocks,
                                                 extra=sc if extra_on else None)
                    return jnp.sum(out[:, :1].astype(jnp.float32))

                inputs = (x, w1, w3, s1, s3) if what == "gate|up" else (h, w2, s2)
                try:
                    t = skinny.chain_time(launch, inputs) - base
                except Exception as exc:  # noqa: BLE001 - a setting that does not compile is a row too
                    print(f"{what} {pairs} pairs {label}: failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
                    rows.append({"launch": what, "pairs": pairs, "tiles": label, "us": float("nan")})
                    continue
                moved = pairs * nbytes
                n_dim = f if what == "gate|up" else d
                programs = pairs * (n_dim // min(blocks.block_n, n_dim))
                row = {"launch": what, "pairs": pairs, "tiles": label, "programs": programs,
                       "us": t * 1e6, "tb_s": moved / t / 1e12, "pct_4_3": moved / t / HBM_ACHIEVABLE}
                rows.append(row)
                print(f"{what:8s} {pairs} pairs {label:26s} programs {row['programs']:4d} {row['us']:7.2f} us "
                      f"{row['tb_s']:.2f} TB/s", flush=True)
    print(table(rows, ["launch", "pairs", "tiles", "programs", "us", "tb_s", "pct_4_3"]))
    print("wrote", write("pair_tiles", {"benchmark": "pair_tiles", "shape": s, "reps": skinny.REPS,
                                        "chain_overhead_us": base * 1e6, "env": environment(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
