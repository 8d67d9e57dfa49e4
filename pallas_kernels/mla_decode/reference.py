"""Reference for absorbed MLA decode over a latent cache (arch §5.4).

Each cached slot is [c_kv (R) | k_pe (P)]; the key of a slot is the whole row, its value the
first R entries. For Sq query tokens per row (speculative verification when Sq > 1), query t
sees slots [0, lengths - Sq + t].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def validate_inputs(q_lat, q_pe, cache, lengths) -> None:
    if q_lat.ndim != 4 or q_pe.ndim != 4 or q_lat.shape[:3] != q_pe.shape[:3]:
        raise ValueError(f"mla_decode: q_lat [B, Sq, H, R] and q_pe [B, Sq, H, P] must agree, got "
                         f"{q_lat.shape} and {q_pe.shape}")
    b, _, _, r = q_lat.shape
    if cache.ndim != 3 or cache.shape[0] != b or cache.shape[2] != r + q_pe.shape[3]:
        raise ValueError(f"mla_decode: cache must be [B, S, R + P] = [{b}, S, {r + q_pe.shape[3]}], "
                         f"got {cache.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"mla_decode: lengths must be [{b}], got {lengths.shape}")


def mla_decode_reference(q_lat, q_pe, cache, lengths, *, scale: float):
    """q_lat [B, Sq, H, R], q_pe [B, Sq, H, P], cache [B, S, R + P], lengths [B] -> [B, Sq, H, R] fp32."""
    validate_inputs(q_lat, q_pe, cache, lengths)
    b, sq, h, r = q_lat.shape
    s = cache.shape[1]
    c = cache.astype(jnp.float32)
    scores = (jnp.einsum("bthr,bsr->bths", q_lat.astype(jnp.float32), c[..., :r], precision=_HIGHEST)
              + jnp.einsum("bthp,bsp->bths", q_pe.astype(jnp.float32), c[..., r:], precision=_HIGHEST)) * scale
    limit = lengths[:, None] - sq + jnp.arange(sq)[None, :]                 # [B, Sq] last visible slot
    mask = jnp.arange(s)[None, None, :] <= limit[:, :, None]
    scores = jnp.where(mask[:, :, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[:, :, None, :], probs, 0.0)  # rows with nothing visible give zeros, not NaN
    return jnp.einsum("bths,bsr->bthr", probs, c[..., :r], precision=_HIGHEST)
