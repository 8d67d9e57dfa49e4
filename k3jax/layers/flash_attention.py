"""Causal self-attention in key blocks with an online softmax (the flash-attention form), pure JAX.

Nothing of size [T, T] is built: query blocks run one after another (`lax.map`), and each visits
only the key blocks at or left of the diagonal (a `fori_loop` whose trip count depends on the query
block), keeping a running fp32 max, denominator and accumulator per query. Peak memory is the
inputs, the output and O(B * H * block_q * block_k) for one block of scores.

The query and key sides are given as matching parts whose dot products add up to the score, so
the same loop serves per-head keys ([B, S, H, K], multi-head) and keys shared by every head
([B, S, K], multi-query, e.g. MLA latents or the rope key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_FLOOR = -1e30  # running max before any visible key: finite, so exp(m - m_new) is never NaN


def _pad_tokens(x: jax.Array, size: int) -> jax.Array:
    """Zero-pads (False for bools) axis 1 of x up to `size`."""
    return jnp.pad(x, [(0, 0), (0, size - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _block(x: jax.Array, index, size: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def _scores(q_parts, k_parts) -> jax.Array:
    """Sum over parts of q [B, Q, H, K] . k ([B, S, H, K] per head or [B, S, K] shared) -> [B, H, Q, S] fp32."""
    total = 0.0
    for q, k in zip(q_parts, k_parts):
        spec = "bqhd,bshd->bhqs" if k.ndim == 4 else "bqhd,bsd->bhqs"
        total = total + jnp.einsum(spec, q, k, preferred_element_type=jnp.float32)
    return total


def _mix(probs_BHQS: jax.Array, values) -> jax.Array:
    """probs [B, H, Q, S] over values ([B, S, H, V] per head or [B, S, V] shared) -> [B, H, Q, V] fp32."""
    spec = "bhqs,bshv->bhqv" if values.ndim == 4 else "bhqs,bsv->bhqv"
    return jnp.einsum(spec, probs_BHQS.astype(values.dtype), values, preferred_element_type=jnp.float32)


def online_softmax_init(b: int, h: int, q: int, v_dim: int):
    """(running max, denominator, accumulator) before any key: [B, H, Q], [B, H, Q], [B, H, Q, V] fp32."""
    return (jnp.full((b, h, q), _FLOOR, jnp.float32), jnp.zeros((b, h, q), jnp.float32),
            jnp.zeros((b, h, q, v_dim), jnp.float32))


def online_softmax_step(carry, q_parts, k_parts, values, visible_BQS: jax.Array, scale: float):
    """One key block into the running (max, denominator, accumulator): scores of the query block
    against the key block (summed over parts, scaled), invisible keys dropped."""
    m_BHQ, l_BHQ, acc_BHQV = carry
    s = _scores(q_parts, k_parts) * scale
    s = jnp.where(visible_BQS[:, None], s, -jnp.inf)
    m_new = jnp.maximum(m_BHQ, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m_BHQ - m_new)
    return m_new, l_BHQ * alpha + p.sum(axis=-1), acc_BHQV * alpha[..., None] + _mix(p, values)


def flash_attention(q_parts: tuple[jax.Array, ...], k_parts: tuple[jax.Array, ...], values: jax.Array,
                    valid_BT: jax.Array, *, scale: float, block_q: int = 512, block_k: int = 512) -> jax.Array:
    """Causal softmax attention of T tokens over themselves, blockwise.

    Args:
      q_parts: query parts, each [B, T, H, K_i].
      k_parts: the matching key parts, each [B, T, H, K_i] (per head) or [B, T, K_i] (shared).
      values: [B, T, H, V] (per head) or [B, T, V] (shared).
      valid_BT: [B, T] bool, keys that may be attended (left padding is False). Query t sees keys
        s <= t with valid[b, s]; a query that sees none gets zeros.
      scale: multiplies the summed scores before the fp32 softmax.
      block_q, block_k: tokens per query / key block (capped at T; T need not be a multiple).
    Returns:
      [B, T, H, V] fp32.
    """
    b, t, h = q_parts[0].shape[:3]
    bq, bk = min(block_q, t), min(block_k, t)
    nq, nk = -(-t // bq), -(-t // bk)
    q_parts = tuple(_pad_tokens(q, nq * bq) for q in q_parts)
    k_parts = tuple(_pad_tokens(k, nk * bk) for k in k_parts)
    values, valid_BT = _pad_tokens(values, nk * bk), _pad_tokens(valid_BT.astype(bool), nk * bk)
    v_dim = values.shape[-1]

    def query_block(i):
        q_blk = tuple(_block(q, i, bq) for q in q_parts)
        q_pos = i * bq + jnp.arange(bq)

        def key_block(j, carry):
            k_pos = j * bk + jnp.arange(bk)
            visible_BQS = (q_pos[:, None] >= k_pos[None, :])[None] & _block(valid_BT, j, bk)[:, None, :]
            return online_softmax_step(carry, q_blk, tuple(_block(k, j, bk) for k in k_parts), _block(values, j, bk),
                                       visible_BQS, scale)

        last = jnp.minimum(((i + 1) * bq + bk - 1) // bk, nk)  # key blocks at or left of the diagonal
        _, l_BHQ, acc_BHQV = lax.fori_loop(0, last, key_block, online_softmax_init(b, h, bq, v_dim))
        return acc_BHQV / jnp.where(l_BHQ > 0, l_BHQ, 1.0)[..., None]

    out_NBHQV = lax.map(query_block, jnp.arange(nq))
    out_BTHV = out_NBHQV.transpose(1, 0, 3, 2, 4).reshape(b, nq * bq, h, v_dim)
    return out_BTHV[:, :t]
