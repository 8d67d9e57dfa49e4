"""Two calls of the Pallas one-token KDA step (one layer) and nothing else: the program that `ncu` profiles
(gpu_session step `kda-decode-ncu`).

    python3 benchmarks/kda_decode_once.py --batch 64 [--heads 32] [--warps 4] [--splits 1]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.kda import DecodeBlocks, KDADecodeInputs, KDADecodeWeights, kda_decode  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4, help="DecodeBlocks.num_warps")
    ap.add_argument("--splits", type=int, default=1, help="DecodeBlocks.value_blocks (0: the auto rule)")
    args = ap.parse_args(argv)
    if min(args.batch, args.heads, args.dim) < 1:
        ap.error("--batch, --heads and --dim must be >= 1")
    b, h, d = args.batch, args.heads, args.dim
    ks = jax.random.split(jax.random.key(0), 9)
    n = lambda i, shape, dt=jnp.float32, s=1.0: (s * jax.random.normal(ks[i], shape, jnp.float32)).astype(dt)
    inputs = KDADecodeInputs(n(0, (b, 3, h, d), jnp.bfloat16), n(1, (b, h, d), jnp.bfloat16),
                             n(2, (b, h), jnp.bfloat16), n(3, (b, h, d), jnp.bfloat16))
    taps = n(4, (4, 3, h, d), s=0.5)
    weights = KDADecodeWeights(q_conv=taps[:, 0], k_conv=taps[:, 1], v_conv=taps[:, 2], dt_bias=n(5, (h, d)),
                               a_log=n(6, (h, d)), o_norm_w=n(7, (d,)))
    conv = n(8, (b, 3, 3, h, d), jnp.bfloat16)
    state = 0.1 * jax.random.normal(jax.random.key(1), (b, h, d, d), jnp.float32)
    blocks = DecodeBlocks(num_warps=args.warps, value_blocks=args.splits)
    call = jax.jit(lambda c, s: kda_decode(inputs, weights, c, s, impl="pallas", blocks=blocks), donate_argnums=(0, 1))
    for _ in range(2):
        out, conv, state = jax.block_until_ready(call(conv, state))
    print(f"B={b} H={h} K=V={d} {args.warps}w/{args.splits}v: out {out.shape} "
          f"finite {bool(jnp.isfinite(out.astype(jnp.float32)).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
