"""Bias-free linear layer, token embedding, and few-row projections that share one launch."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.params import normal, param
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

    def __call__(self, x: jax.Array, *, out_dtype=None) -> jax.Array:
        """x: [..., in] -> [..., out] (accumulated in fp32 when `out_dtype` is float32)."""
        return linears([(x, (self,))], out_dtype=out_dtype)[0][0]


def takes_fused_kernel(groups) -> bool:
    """Whether projections (groups of (x, layers[, out_dtype])) take the fused few-row kernel: at
    most SKINNY_MAX_ROWS rows and every layer's impl resolving to "pallas". Layers are `Linear`s
    or anything with a `kernel` [in, out] and an `impl`."""
    rows = {g[0].size // g[0].shape[-1] for g in groups}
    return (len(rows) == 1 and max(rows) <= SKINNY_MAX_ROWS
            and all(resolve_skinny_impl(lin.impl) == "pallas" for g in groups for lin in g[1]))


def linears(groups: Sequence[tuple], *, out_dtype=None) -> list[list[jax.Array]]:
    """Applies each group's layers to the group's input: groups of (x [..., in], layers) or (x, layers,
    out_dtype); per group, per layer, [..., out]. Few-row calls (decode) run every group in ONE kernel
    launch (`pallas_kernels.skinny.fused_projections`: each weight read once, narrow weights split
    over the reduction axis); other calls are one XLA dot per layer."""
    dtypes = [g[2] if len(g) > 2 else out_dtype for g in groups]
    if not takes_fused_kernel(groups):
        return [[jnp.einsum("...i,io->...o", g[0].astype(lin.kernel.dtype), lin.kernel[...], preferred_element_type=dt)
                 for lin in g[1]] for g, dt in zip(groups, dtypes)]
    flat = [(g[0].reshape(-1, g[0].shape[-1]).astype(g[1][0].kernel.dtype), tuple(lin.kernel[...] for lin in g[1]))
            for g in groups]
    outs = fused_projections(flat, impl="pallas", out_dtype=tuple(dtypes))
    result = []
    for (x, layers, *_), out in zip(groups, outs):
        cols, pieces = 0, []
        for lin in layers:
            n = lin.kernel.shape[1]
            pieces.append(out[:, cols:cols + n].reshape(x.shape[:-1] + (n,)))
            cols += n
        result.append(pieces)
    return result


class Embedding(nnx.Module):
    """Plain lookup table [Vocab, D], no scaling."""

    def __init__(self, vocab_size: int, features: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = param(rngs, (vocab_size, features), dtype, normal(0.02), ("vocab", "embed"))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        """token_ids: [B, T] int -> [B, T, D]."""
        return jnp.take(self.embedding[...], token_ids, axis=0)
