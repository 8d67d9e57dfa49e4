"""Bias-free linear layer, token embedding, and few-row projections that share one launch."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.params import normal, param
from k3jax.layers.residual import SplitSum
from pallas_kernels.skinny import SKINNY_MAX_ROWS, SkinnyImpl, fused_projections, resolve_skinny_impl


class Linear(nnx.Module):
    """y = x @ kernel with kernel [in, out] (a checkpoint's [out, in] weight, transposed).

    `impl` chooses how a call with at most SKINNY_MAX_ROWS rows (decode) runs
    (`pallas_kernels.skinny`); larger calls are one XLA dot.
    """

    def __init__(self, in_features: int, out_features: int, *, dtype, axes: Sequence[str | None],
                 rngs: nnx.Rngs, std: float = 0.02, impl: SkinnyImpl = "auto"):
        self.kernel = param(rngs, (in_features, out_features), dtype, normal(std), axes)
        self.impl = impl

    def __call__(self, x: jax.Array, *, out_dtype=None, partial: bool = False):
        """x: [..., in] -> [..., out] (accumulated in fp32 when `out_dtype` is float32).

        partial: on the few-row kernel path, return the fp32 partial sums over its slices of the
        reduction axis as a `k3jax.layers.residual.SplitSum` for an add that sums them itself."""
        if partial and takes_fused_kernel([(x, (self,))]):
            (parts,), = linears([(x, (self,))], partial_sums=(0,))
            return SplitSum(parts, 0, x.shape[:-1] + (self.kernel.shape[1],), out_dtype or self.kernel.dtype)
        return linears([(x, (self,))], out_dtype=out_dtype)[0][0]


def takes_fused_kernel(groups) -> bool:
    """Whether projections (groups of (x, layers[, out_dtype])) take the fused few-row kernel: at
    most SKINNY_MAX_ROWS rows and every layer's impl resolving to "pallas". Layers are `Linear`s
    or anything with a `kernel` [in, out] and an `impl`."""
    rows = {g[0].size // g[0].shape[-1] for g in groups}
    return (len(rows) == 1 and max(rows) <= SKINNY_MAX_ROWS
            and all(resolve_skinny_impl(lin.impl) == "pallas" for g in groups for lin in g[1]))


def linears(groups: Sequence[tuple], *, out_dtype=None, partial_sums: Sequence[int] = ()) -> list[list[jax.Array]]:
    """Applies each group's layers to the group's input: groups of (x [..., in], layers) or (x, layers,
    out_dtype); per group, per layer, [..., out]. Few-row calls (decode) run every group in ONE kernel
    launch (`pallas_kernels.skinny.fused_projections`: each weight read once, narrow weights split
    over the reduction axis); other calls are one XLA dot per layer.

    Groups listed in `partial_sums` come back as fp32 partial sums [S, ..., out] whose sum over the
    first axis is the product (S = 1 off the kernel), for a consumer kernel that adds them itself."""
    dtypes = [jnp.float32 if i in partial_sums else (g[2] if len(g) > 2 else out_dtype) for i, g in enumerate(groups)]
    if not takes_fused_kernel(groups):
        return [[_partial(jnp.einsum("...i,io->...o", g[0].astype(lin.kernel.dtype), lin.kernel[...],
                                     preferred_element_type=dt), i in partial_sums)
                 for lin in g[1]] for i, (g, dt) in enumerate(zip(groups, dtypes))]
    flat = [(g[0].reshape(-1, g[0].shape[-1]).astype(g[1][0].kernel.dtype), tuple(lin.kernel[...] for lin in g[1]))
            for g in groups]
    outs = fused_projections(flat, impl="pallas", out_dtype=tuple(dtypes), partial_groups=tuple(partial_sums))
    result = []
    for i, ((x, layers, *_), out) in enumerate(zip(groups, outs)):
        lead = out.shape[:1] if i in partial_sums else ()
        cols, pieces = 0, []
        for lin in layers:
            n = lin.kernel.shape[1]
            pieces.append(out[..., cols:cols + n].reshape(lead + x.shape[:-1] + (n,)))
            cols += n
        result.append(pieces)
    return result


def _partial(y: jax.Array, partial: bool) -> jax.Array:
    return y[None] if partial else y


class Embedding(nnx.Module):
    """Plain lookup table [Vocab, D], no scaling."""

    def __init__(self, vocab_size: int, features: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = param(rngs, (vocab_size, features), dtype, normal(0.02), ("vocab", "embed"))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        """token_ids: [B, T] int -> [B, T, D]."""
        return jnp.take(self.embedding[...], token_ids, axis=0)
