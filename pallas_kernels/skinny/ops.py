"""The dispatch site of the few-row (decode-time) projections.

    fused_projections([(x_g, [w_g0, w_g1, ...]), ...], impl=...)  ->  [x_g @ concat(w_g.., axis=1), ...]

impl "xla": one XLA dot per group (the reference; XLA turns one-row dots into multiply + reduce
kernels on the GPU). impl "pallas": every group in one launch of the fused kernel (`kernel.py`).
impl "auto": "pallas" on a GPU backend, "xla" elsewhere. Calls of more than SKINNY_MAX_ROWS rows,
and weights whose sides are not multiples of 16, always take the dots.
"""

from __future__ import annotations

from typing import Literal, Sequence, get_args

import jax
import jax.numpy as jnp

from pallas_kernels.skinny.kernel import ROWS, fused_projections_pallas
from pallas_kernels._util import tiles_by_16
from pallas_kernels.skinny.plan import SkinnyBlocks
from pallas_kernels.skinny.reference import fused_projections_reference

SkinnyImpl = Literal["auto", "xla", "pallas"]
SKINNY_IMPLS: tuple[str, ...] = get_args(SkinnyImpl)
SKINNY_MAX_ROWS = ROWS


def resolve_skinny_impl(impl: SkinnyImpl) -> str:
    """"auto" -> "pallas" on a GPU backend, "xla" elsewhere; other names unchanged."""
    if impl not in SKINNY_IMPLS:
        raise ValueError(f"few-row projections: unknown impl {impl!r}; expected one of {SKINNY_IMPLS}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def fused_projections(groups: Sequence[tuple[jax.Array, Sequence[jax.Array]]], *, impl: SkinnyImpl = "auto",
                      out_dtype=None, blocks: SkinnyBlocks = SkinnyBlocks(),
                      partial_groups: Sequence[int] = ()) -> list[jax.Array]:
    """Per group, its input times its weights side by side, every kernel-able group in one launch.

    Args:
      groups: (x [M, K_g], weights [K_g, N] ...) per group, the same M for all.
      impl: one of SKINNY_IMPLS. out_dtype: result dtype, or a tuple of one per group (default each
        input's); fp32 accumulation.
      blocks: the kernel's launch plan settings.
      partial_groups: groups returned as fp32 partial sums [S, M, sum N] over the kernel's slices of
        the reduction axis (S = 1 when unsplit or not on the kernel), for consumers that add them.
    Returns:
      per group [M, sum N] ([S, M, sum N] for partial_groups).
    """
    impl = resolve_skinny_impl(impl)
    dtypes = tuple(out_dtype) if isinstance(out_dtype, (tuple, list)) else (out_dtype,) * len(groups)
    rows = {x.shape[0] for x, _ in groups}
    use_kernel = impl == "pallas" and len(rows) == 1 and max(rows) <= SKINNY_MAX_ROWS
    # Weights the kernel takes (sides multiples of 16), per group; the rest are dots.
    picked = [[use_kernel and tiles_by_16(x.shape[1], w.shape[1]) for w in ws] for x, ws in groups]
    chosen = [g for g, p in enumerate(picked) if any(p)]
    partial = set(partial_groups)
    partial_kernel = {g for g in partial if all(picked[g])}
    dtypes = tuple(jnp.float32 if g in partial else d for g, d in enumerate(dtypes))
    fused = {}
    if chosen:
        xs = tuple(groups[g][0] for g in chosen)
        weights = tuple(w for g in chosen for w, p in zip(groups[g][1], picked[g]) if p)
        outs = fused_projections_pallas(xs, weights, counts=tuple(sum(picked[g]) for g in chosen),
                                        out_dtype=tuple(jnp.dtype(dtypes[g] or groups[g][0].dtype) for g in chosen),
                                        blocks=blocks,
                                        partial_groups=tuple(i for i, g in enumerate(chosen) if g in partial_kernel))
        fused = dict(zip(chosen, outs))
    results = []
    for g, (x, ws) in enumerate(groups):
        if all(picked[g]):
            results.append(fused[g])
            continue
        if g in partial:   # some weight off the kernel: the whole group as XLA dots, one "slice"
            results.append(fused_projections_reference((x,), tuple(ws), counts=(len(ws),), out_dtype=jnp.float32)[0][None])
            continue
        pieces, col = [], 0
        for w, p in zip(ws, picked[g]):
            if p:
                pieces.append(fused[g][:, col:col + w.shape[1]])
                col += w.shape[1]
            else:
                pieces.append(fused_projections_reference((x,), (w,), counts=(1,), out_dtype=dtypes[g])[0])
        results.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1))
    return results


def skinny_matmul(x_MK, w_KN, *, impl: SkinnyImpl = "auto", out_dtype=None, blocks: SkinnyBlocks = SkinnyBlocks()):
    """x [M, K] @ w [K, N] for a few rows M (one group of one weight); -> [M, N]."""
    return fused_projections([(x_MK, (w_KN,))], impl=impl, out_dtype=out_dtype, blocks=blocks)[0]
