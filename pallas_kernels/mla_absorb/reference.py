"""XLA twins of the absorbed MLA projections (`kernel.py`): the same contracts as einsums."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla_absorb.kernel import padded_tokens
from pallas_kernels.rms_norm import rms_norm_reference


def _heads(w_kv_b, heads: int, nope: int):
    """kv_b_proj kernel [R, H * (nope + v)] -> (W_UK [R, H, nope], W_UV [R, H, v])."""
    w = w_kv_b.reshape(w_kv_b.shape[0], heads, -1)
    return w[..., :nope], w[..., nope:]


def absorb_query_reference(q, w_kv_b, *, heads: int, tokens: int, nope: int, rope: int, v_dim: int, q_col: int = 0,
                           multiple: int = 1, out_dtype=None, kv=None, kv_col: int = 0, norm_weight=None,
                           eps: float = 1e-6, cache=None, slots=None):
    """`kernel.absorb_query_pallas`'s contract; its padding rows are zeros here."""
    del v_dim
    m = q.shape[0]
    r = w_kv_b.shape[0]
    q = q[:, q_col:q_col + heads * (nope + rope)].reshape(m, heads, nope + rope)
    w_uk, _ = _heads(w_kv_b, heads, nope)
    q_lat = jnp.einsum("mhn,rhn->mhr", q[..., :nope], w_uk, preferred_element_type=jnp.float32)
    dtype = out_dtype or q.dtype
    rows = jnp.concatenate([q_lat.astype(dtype), q[..., nope:].astype(dtype)], -1)
    batch, t_pad = m // tokens, padded_tokens(tokens, heads, multiple)
    rows = jnp.pad(rows.reshape(batch, tokens, heads, -1), ((0, 0), (0, t_pad - tokens), (0, 0), (0, 0)))
    rows = rows.reshape(batch * t_pad, heads, r + rope)
    if kv is None:
        return rows
    kv = kv[:, kv_col:kv_col + r + rope]
    latents = jnp.concatenate([rms_norm_reference(kv[:, :r], norm_weight, eps), kv[:, r:]], -1)
    if cache is None:
        return rows, latents
    slots = jnp.where(slots < 0, cache.shape[1], slots)          # padding rows: past the end, dropped
    return rows, cache.at[jnp.arange(m) // tokens, slots].set(latents.astype(cache.dtype), mode="drop")


def absorb_value_reference(o, w_kv_b, *, heads: int, tokens: int, nope: int, v_dim: int, lse=None, out_dtype=None):
    """`kernel.absorb_value_pallas`'s contract."""
    del v_dim
    _, w_uv = _heads(w_kv_b, heads, nope)
    dtype = out_dtype or o.dtype
    if lse is not None:   # merge the splits: [B, S, rows, R] -> [B * T, H, R]
        b = o.shape[0]
        w = jnp.exp2(lse - jnp.max(lse, axis=1, keepdims=True))
        lat = jnp.sum(o.astype(jnp.float32) * w[..., None], axis=1) / jnp.sum(w, axis=1)[..., None]
        o = lat[:, :tokens * heads].reshape(b * tokens, heads, -1)
    out = jnp.einsum("mhr,rhv->mhv", o.astype(jnp.float32), w_uv.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(dtype)
