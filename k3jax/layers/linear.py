"""Bias-free linear layer and token embedding."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.params import normal, param


class Linear(nnx.Module):
    """y = x @ kernel with kernel [in, out] (a checkpoint's [out, in] weight, transposed)."""

    def __init__(self, in_features: int, out_features: int, *, dtype, axes: Sequence[str | None],
                 rngs: nnx.Rngs, std: float = 0.02):
        self.kernel = param(rngs, (in_features, out_features), dtype, normal(std), axes)

    def __call__(self, x: jax.Array, *, out_dtype=None) -> jax.Array:
        """x: [..., in] -> [..., out] (accumulated in fp32 when `out_dtype` is float32)."""
        kernel = self.kernel[...]
        return jnp.einsum("...i,io->...o", x.astype(kernel.dtype), kernel,
                          preferred_element_type=out_dtype)


class Embedding(nnx.Module):
    """Plain lookup table [Vocab, D], no scaling."""

    def __init__(self, vocab_size: int, features: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = param(rngs, (vocab_size, features), dtype, normal(0.02), ("vocab", "embed"))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        """token_ids: [B, T] int -> [B, T, D]."""
        return jnp.take(self.embedding[...], token_ids, axis=0)
