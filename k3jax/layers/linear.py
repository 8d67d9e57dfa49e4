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


def _few_rows(groups) -> bool:
    """Whether a set of projections takes the fused few-row kernel: at most SKINNY_MAX_ROWS rows
    and every layer's impl resolving to "pallas"."""
    rows = {x.size // x.shape[-1] for x, _ in groups}
    return (len(rows) == 1 and max(rows) <= SKINNY_MAX_ROWS
            and all(resolve_skinny_impl(lin.impl) == "pallas" for _, layers in groups for lin in layers))


def linears(groups: Sequence[tuple[jax.Array, Sequence[Linear]]], *, out_dtype=None) -> list[list[jax.Array]]:
    """Applies each group's layers to the group's input: per group, per layer, x [..., in] ->
    [..., out]. Few-row calls (decode) run every group in ONE kernel launch
    (`pallas_kernels.skinny.fused_projections`: each weight read once, narrow weights split over
    the reduction axis); other calls are one XLA dot per layer."""
    if not _few_rows(groups):
        return [[jnp.einsum("...i,io->...o", x.astype(lin.kernel.dtype), lin.kernel[...],
                            preferred_element_type=out_dtype) for lin in layers] for x, layers in groups]
    flat = [(x.reshape(-1, x.shape[-1]).astype(layers[0].kernel.dtype), tuple(lin.kernel[...] for lin in layers))
            for x, layers in groups]
    outs = fused_projections(flat, impl="pallas", out_dtype=out_dtype)
    result = []
    for (x, layers), out in zip(groups, outs):
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
