"""Two calls of the Hopper MLA decode kernel and nothing else: the program that `ncu` profiles
(gpu_session step `mla-ncu`), one form of `mla_decode.HOPPER_FORMS` at one shape.

    python3 benchmarks/mla_decode_once.py --impl hopper --shape 96x64x4096 [--q 1]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.mla_decode import HOPPER_FORMS  # noqa: E402
from pallas_kernels.mla_decode.hopper import HopperMLABlocks, mla_decode_hopper  # noqa: E402

LATENT, ROPE = 512, 64


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="hopper", choices=sorted(HOPPER_FORMS))
    ap.add_argument("--shape", default="96x64x4096", help="HxBxCTX")
    ap.add_argument("--q", type=int, default=1, help="query tokens per row")
    ap.add_argument("--splits", type=int, default=0, help="HopperMLABlocks.num_splits (0: auto)")
    args = ap.parse_args(argv)
    try:
        h, b, ctx = (int(x) for x in args.shape.split("x"))
    except ValueError:
        ap.error(f"--shape must be HxBxCTX, e.g. 96x64x4096; got {args.shape!r}")
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, args.q, h, LATENT), jnp.bfloat16)
    qp = jax.random.normal(ks[1], (b, args.q, h, ROPE), jnp.bfloat16)
    cache = jax.random.normal(ks[2], (b, ctx, LATENT + ROPE), jnp.bfloat16)
    lengths = jnp.full((b,), ctx, jnp.int32)
    blocks = HopperMLABlocks(num_splits=args.splits, **HOPPER_FORMS[args.impl])
    call = jax.jit(lambda *a: mla_decode_hopper(*a, scale=192 ** -0.5, blocks=blocks))
    for _ in range(2):
        out = jax.block_until_ready(call(q, qp, cache, lengths))
    print(f"{args.impl} H={h} B={b} ctx={ctx} q={args.q}: out {out.shape} "
          f"finite {bool(jnp.isfinite(out.astype(jnp.float32)).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
