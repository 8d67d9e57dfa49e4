"""Attention residuals: softmax attention over depth (K3, arch §3.3).

For sources v_j (each [..., D]), norm weight gamma [D] and projection w [D]:
    s_j = sum_d gamma_d w_d v_j[d] / sqrt(mean_d v_j[d]^2 + eps)
    AR  = sum_j softmax_j(s)_j v_j          (the RAW sources are mixed)
No temperature, no 1/sqrt(D), no bias; all in fp32.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.linear import Linear
from k3jax.layers.norms import RMSNorm, rms_normalize

# How a decoder stack keeps its blocks (k3jax.model): "buffer" (a fixed-size buffer with validity
# masks, the jit form) or "list" (a growing Python list: the reference).
AttnResImpl = Literal["buffer", "list"]
ATTN_RES_IMPLS: tuple[str, ...] = get_args(AttnResImpl)


def attn_res_mix(sources_S: jax.Array, valid_S: jax.Array, gamma_D: jax.Array, w_D: jax.Array, eps: float,
                 out_dtype) -> jax.Array:
    """Mixes a fixed-size stack of sources [S, ..., D]; only sources with valid_S[j] take part."""
    v = sources_S.astype(jnp.float32)
    query = gamma_D.astype(jnp.float32) * w_D.astype(jnp.float32)
    scores = jnp.einsum("s...d,d->s...", rms_normalize(v, eps), query)
    scores = jnp.where(valid_S.reshape((-1,) + (1,) * (scores.ndim - 1)), scores, -jnp.inf)
    alpha = jax.nn.softmax(scores, axis=0)
    return jnp.einsum("s...,s...d->...d", alpha, v).astype(out_dtype)


def attn_res_mix_list(sources: list, gamma_D: jax.Array, w_D: jax.Array, eps: float, out_dtype) -> jax.Array:
    """Reference form over a Python list of sources (one score per source, then a softmax)."""
    query = gamma_D.astype(jnp.float32) * w_D.astype(jnp.float32)
    vs = [s.astype(jnp.float32) for s in sources]
    scores = [jnp.sum(rms_normalize(v, eps) * query, axis=-1) for v in vs]
    top = scores[0]
    for s in scores[1:]:
        top = jnp.maximum(top, s)
    weights = [jnp.exp(s - top) for s in scores]
    mixed = sum(wt[..., None] * v for wt, v in zip(weights, vs))
    return (mixed / sum(weights)[..., None]).astype(out_dtype)


class AttnResPoint(nnx.Module):
    """One mixing point's weights: `<name>_norm.weight` [D] and `<name>_proj.weight` [1, D]."""

    def __init__(self, hidden_size: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.norm = RMSNorm(hidden_size, eps, dtype=dtype, rngs=rngs)
        self.proj = Linear(hidden_size, 1, dtype=dtype, axes=("embed", None), rngs=rngs)

    def mix(self, sources_S: jax.Array, valid_S: jax.Array, out_dtype) -> jax.Array:
        with jax.named_scope("attn_res"):
            return attn_res_mix(sources_S, valid_S, self.norm.weight[...], self.proj.kernel[:, 0], self.eps, out_dtype)

    def mix_list(self, sources: list, out_dtype) -> jax.Array:
        return attn_res_mix_list(sources, self.norm.weight[...], self.proj.kernel[:, 0], self.eps, out_dtype)
