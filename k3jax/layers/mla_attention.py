"""NoPE MLA attention math over a set of latent keys (arch §5.2, §5.4).

All forms take the same inputs: per-head query parts and a latent key set
latent_BSL = [c_kv (R, after kv_a_layernorm) | k_pe (rope width, never rotated)], plus the
kv_b_proj kernel [R, H * (nope + v)] (head-major, key part first). Scores use scale
(nope + rope)^-1/2; the softmax is fp32.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from k3jax.layers.flash_attention import flash_attention
from pallas_kernels.mla_decode import mla_decode_pallas

# Attention over the latent cache (steps with history): "absorbed" (pure JAX, W_UK folded into
# the query), "naive" (keys and values expanded per head: the reference) or "pallas" (the
# flash-decoding kernel over the cache).
MLADecodeImpl = Literal["absorbed", "naive", "pallas"]
MLA_DECODE_IMPLS: tuple[str, ...] = get_args(MLADecodeImpl)

# Attention of a fresh prompt over its own tokens (no history): "flash" (blockwise online softmax,
# memory linear in T) or "naive" (the reference: a [B, H, T, T] score matrix).
MLAPrefillImpl = Literal["flash", "naive"]
MLA_PREFILL_IMPLS: tuple[str, ...] = get_args(MLAPrefillImpl)

_MASKED = -1e30


def _softmax(scores_BHTS: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    scores = jnp.where(mask_BTS[:, None], scores_BHTS, _MASKED)
    return jax.nn.softmax(scores, axis=-1)


def split_kv_b(w_kv_b: jax.Array, num_heads: int, nope: int, v_dim: int) -> tuple[jax.Array, jax.Array]:
    """kv_b_proj kernel [R, H*(nope+v)] -> (W_UK [R, H, nope], W_UV [R, H, v])."""
    w = w_kv_b.reshape(w_kv_b.shape[0], num_heads, nope + v_dim)
    return w[..., :nope], w[..., nope:]


def expand_kv(latent_BSL, w_kv_b, num_heads: int, nope: int, v_dim: int):
    """Per-head keys and values from the latents -> (k_nope [B, S, H, nope], k_pe [B, S, P] shared,
    values [B, S, H, V]), in the latent dtype."""
    r = w_kv_b.shape[0]
    c_kv, k_pe = latent_BSL[..., :r], latent_BSL[..., r:]
    w_uk, w_uv = split_kv_b(w_kv_b, num_heads, nope, v_dim)
    return jnp.einsum("bsr,rhn->bshn", c_kv, w_uk), k_pe, jnp.einsum("bsr,rhv->bshv", c_kv, w_uv)


def attention_naive(q_nope_BTHN, q_pe_BTHP, latent_BSL, w_kv_b, mask_BTS, *, scale: float, v_dim: int):
    """Expands per-head keys and values from the latents, then plain attention. -> [B, T, H, V]."""
    k_nope, k_pe, values = expand_kv(latent_BSL, w_kv_b, *q_nope_BTHN.shape[2:], v_dim)
    scores = (jnp.einsum("bthn,bshn->bhts", q_nope_BTHN, k_nope, preferred_element_type=jnp.float32)
              + jnp.einsum("bthp,bsp->bhts", q_pe_BTHP, k_pe, preferred_element_type=jnp.float32))
    probs = _softmax(scores * scale, mask_BTS).astype(values.dtype)
    return jnp.einsum("bhts,bshv->bthv", probs, values)


def attention_absorbed(q_nope_BTHN, q_pe_BTHP, latent_BSL, w_kv_b, mask_BTS, *, scale: float, v_dim: int):
    """W_UK folded into the query and W_UV applied after the latent mix (MQA over latents). -> [B, T, H, V]."""
    b, t, h, n = q_nope_BTHN.shape
    r = w_kv_b.shape[0]
    c_kv, k_pe = latent_BSL[..., :r], latent_BSL[..., r:]
    w_uk, w_uv = split_kv_b(w_kv_b, h, n, v_dim)
    q_lat = jnp.einsum("bthn,rhn->bthr", q_nope_BTHN, w_uk, preferred_element_type=jnp.float32)
    scores = (jnp.einsum("bthr,bsr->bhts", q_lat, c_kv.astype(jnp.float32))
              + jnp.einsum("bthp,bsp->bhts", q_pe_BTHP, k_pe, preferred_element_type=jnp.float32))
    probs = _softmax(scores * scale, mask_BTS)
    lat = jnp.einsum("bhts,bsr->bthr", probs, c_kv.astype(jnp.float32))
    return jnp.einsum("bthr,rhv->bthv", lat, w_uv.astype(jnp.float32)).astype(q_nope_BTHN.dtype)


def attention_flash(q_nope_BTHN, q_pe_BTHP, latent_BTL, w_kv_b, valid_BT, *, scale: float, v_dim: int,
                    block_q: int = 512, block_k: int = 512):
    """Causal attention of T fresh tokens over themselves, blockwise with an online softmax.

    Keys and values are expanded per head once (linear in T, like the queries), then
    `flash_attention` walks the key blocks; no [T, T] buffer exists. valid_BT [B, T] marks real
    tokens (left padding False). -> [B, T, H, V] in the latent dtype.
    """
    k_nope, k_pe, values = expand_kv(latent_BTL, w_kv_b, *q_nope_BTHN.shape[2:], v_dim)
    out = flash_attention((q_nope_BTHN, q_pe_BTHP), (k_nope, k_pe), values, valid_BT, scale=scale,
                          block_q=block_q, block_k=block_k)
    return out.astype(values.dtype)


def prefill_attention(impl: MLAPrefillImpl, q_nope_BTHN, q_pe_BTHP, latent_BTL, w_kv_b, valid_BT, *,
                      scale: float, v_dim: int) -> jax.Array:
    """Causal attention of a fresh prompt over its own tokens (the one dispatch site of MLA prefill).

    Args:
      q_nope_BTHN, q_pe_BTHP: per-head query parts. latent_BTL: [B, T, R + P] this call's latents.
      w_kv_b: kv_b_proj kernel [R, H * (nope + v)].
      valid_BT: [B, T] bool real tokens (rows are left-padded); query t sees keys s <= t that are valid.
    Returns:
      [B, T, H, V] in the latent dtype.
    """
    kw = dict(scale=scale, v_dim=v_dim)
    if impl == "flash":
        return attention_flash(q_nope_BTHN, q_pe_BTHP, latent_BTL, w_kv_b, valid_BT, **kw)
    if impl == "naive":
        idx = jnp.arange(valid_BT.shape[1])
        mask = valid_BT[:, None, :] & (idx[None, :, None] >= idx[None, None, :])
        return attention_naive(q_nope_BTHN, q_pe_BTHP, latent_BTL, w_kv_b, mask, **kw)
    raise ValueError(f"MLA prefill: unknown impl {impl!r}; expected one of {MLA_PREFILL_IMPLS}")


def cache_attention(impl: MLADecodeImpl, q_nope_BTHN, q_pe_BTHP, cache_BSL, w_kv_b, last_slot_BT, *, scale: float,
                    v_dim: int) -> jax.Array:
    """Attention of T query tokens per row over a latent cache (the one dispatch site of MLA decode).

    Args:
      q_nope_BTHN, q_pe_BTHP: per-head query parts. cache_BSL: [B, S, R + P] latents | k_pe.
      w_kv_b: kv_b_proj kernel [R, H * (nope + v)].
      last_slot_BT: [B, T] int32 the last slot each query sees (its own slot); the T queries of a
        row sit at consecutive slots.
    Returns:
      [B, T, H, V] in the query dtype.
    """
    if impl == "pallas":
        h, n = q_nope_BTHN.shape[2:]
        w_uk, w_uv = split_kv_b(w_kv_b, h, n, v_dim)
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope_BTHN, w_uk, preferred_element_type=jnp.float32)
        lengths = last_slot_BT[:, -1] + 1
        lat = mla_decode_pallas(q_lat.astype(cache_BSL.dtype), q_pe_BTHP, cache_BSL, lengths, scale=scale)
        return jnp.einsum("bthr,rhv->bthv", lat, w_uv.astype(jnp.float32)).astype(q_nope_BTHN.dtype)
    slots = jnp.arange(cache_BSL.shape[1])
    mask = slots[None, None, :] <= last_slot_BT[:, :, None]
    if impl == "absorbed":
        return attention_absorbed(q_nope_BTHN, q_pe_BTHP, cache_BSL, w_kv_b, mask, scale=scale, v_dim=v_dim)
    if impl == "naive":
        return attention_naive(q_nope_BTHN, q_pe_BTHP, cache_BSL, w_kv_b, mask, scale=scale, v_dim=v_dim)
    raise ValueError(f"MLA decode: unknown impl {impl!r}; expected one of {MLA_DECODE_IMPLS}")
