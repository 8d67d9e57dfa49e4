"""Bias-free linear layer and token embedding."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.params import normal, param
from pallas_kernels.moe_gmm import SKINNY_MAX_ROWS, SkinnyImpl, skinny_matmul


class Linear(nnx.Module):
    """y = x @ kernel with kernel [in, out] (a checkpoint's [out, in] weight, transposed).

    `impl` chooses how a call with at most SKINNY_MAX_ROWS rows (decode) runs
    (`pallas_kernels.moe_gmm.skinny_matmul`); larger calls are one XLA dot.
    """

    def __init__(self, in_features: int, out_features: int, *, dtype, axes: Sequence[str | None],
                 rngs: nnx.Rngs, std: float = 0.02, impl: SkinnyImpl = "auto"):
        self.kernel = param(rngs, (in_features, out_features), dtype, normal(std), axes)
        self.impl = impl

    def __call__(self, x: jax.Array, *, out_dtype=None) -> jax.Array:
        """x: [..., in] -> [..., out] (accumulated in fp32 when `out_dtype` is float32)."""
        kernel = self.kernel[...]
        x = x.astype(kernel.dtype)
        rows = x.size // x.shape[-1]
        if rows <= SKINNY_MAX_ROWS and self.impl != "xla":
            out = skinny_matmul(x.reshape(rows, x.shape[-1]), kernel, impl=self.impl, out_dtype=out_dtype)
            return out.reshape(x.shape[:-1] + (kernel.shape[1],))
        return jnp.einsum("...i,io->...o", x, kernel, preferred_element_type=out_dtype)


class Embedding(nnx.Module):
    """Plain lookup table [Vocab, D], no scaling."""

    def __init__(self, vocab_size: int, features: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = param(rngs, (vocab_size, features), dtype, normal(0.02), ("vocab", "embed"))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        """token_ids: [B, T] int -> [B, T, D]."""
        return jnp.take(self.embedding[...], token_ids, axis=0)
