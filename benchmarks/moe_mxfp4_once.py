"""Two calls of one Mosaic GPU MXFP4 launch and nothing else: the program that `ncu` profiles (gpu_session step
`moe-ncu`). Kimi-Linear's routed experts (or another shape of `SHAPES`) at a token count, uniform random
top-k routing, rows sorted by expert as the model sorts them; the gated launch (gate and up, one launch) or the
down launch alone.

    python3 benchmarks/moe_mxfp4_once.py --launch gate --tokens 64 [--model kimi-linear] [--decode scaled]
        [--mma-inputs 0]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.moe_mxfp4 import MODELS, packed  # noqa: E402
from k3jax.layers.moe_experts import sort_by_expert  # noqa: E402
from pallas_kernels.moe_gmm.hopper_mxfp4 import (CODE_LOADS, DECODES, HopperMxfp4Blocks,  # noqa: E402
                                                  grouped_glu_hopper_mxfp4, grouped_matmul_hopper_mxfp4, to_columns)

SHAPES = {**MODELS, "tiny": (8, 128, 128, 2)}      # E, D, F, top-k; "tiny" for an interpret-mode smoke run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", default="gate", choices=("gate", "down"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default="kimi-linear", choices=sorted(SHAPES))
    ap.add_argument("--decode", default=None, choices=DECODES, help="HopperMxfp4Blocks.decode (default: the kernel's)")
    ap.add_argument("--mma-inputs", type=int, default=None, help="HopperMxfp4Blocks.mma_inputs (16, 32 or 0)")
    ap.add_argument("--code-load", default=None, choices=CODE_LOADS, help="HopperMxfp4Blocks.code_load")
    ap.add_argument("--interpret", action="store_true", help="interpret mode (a CPU smoke run, with --model tiny)")
    args = ap.parse_args(argv)
    if args.tokens < 1:
        ap.error(f"--tokens must be >= 1, got {args.tokens}")
    e, d, f, k = SHAPES[args.model]
    rng = np.random.default_rng(0)
    experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(args.tokens)]), jnp.int32)
    order, sizes, _ = sort_by_expert(experts, e)
    rows = args.tokens * k
    interpret = True if args.interpret else None
    fields = {**({"decode": args.decode} if args.decode else {}),
              **({"mma_inputs": args.mma_inputs} if args.mma_inputs is not None else {}),
              **({"code_load": args.code_load} if args.code_load else {})}
    try:
        blocks = HopperMxfp4Blocks.for_backend(args.interpret, d if args.launch == "gate" else f, rows / e,
                                               2 if args.launch == "gate" else 1, **fields)
        if args.interpret and blocks.decode != "exact":
            raise ValueError(f"decode={blocks.decode!r} is inline PTX, which runs compiled only")
        if not args.interpret and blocks.code_load == "words" and blocks.decode == "exact":
            raise ValueError("code_load='words' with decode='exact' runs in interpret mode only")
    except ValueError as exc:
        ap.error(str(exc))
    if args.launch == "gate":
        x = jax.random.normal(jax.random.key(1), (args.tokens, d), jnp.bfloat16)[order // k]
        w_gate, w_up = to_columns(packed(rng, e, d, f)), to_columns(packed(rng, e, d, f))
        call = jax.jit(lambda x, s: grouped_glu_hopper_mxfp4(x, w_gate, w_up, s, blocks=blocks, interpret=interpret))
    else:
        x = jax.random.normal(jax.random.key(1), (rows, f), jnp.bfloat16)
        w_down = to_columns(packed(rng, e, f, d))
        call = jax.jit(lambda x, s: grouped_matmul_hopper_mxfp4(x, w_down, s, blocks=blocks, interpret=interpret))
    for _ in range(2):
        out = jax.block_until_ready(call(x, sizes))
    print(f"{args.model} {args.launch} launch, {args.tokens} tokens ({int((np.asarray(sizes) > 0).sum())} experts "
          f"touched), {blocks}: out {out.shape} finite {bool(jnp.isfinite(out.astype(jnp.float32)).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
