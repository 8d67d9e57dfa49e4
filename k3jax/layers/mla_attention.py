"""NoPE MLA attention math over a set of latent keys (arch §5.2, §5.4).

All forms take the same inputs: per-head query parts and a latent key set
latent_BSL = [c_kv (R, after kv_a_layernorm) | k_pe (rope width, never rotated)], plus the
kv_b_proj kernel [R, H * (nope + v)] (head-major, key part first). Scores use scale
(nope + rope)^-1/2; the softmax is fp32.
"""

from __future__ import annotations

import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.layers.flash_attention import flash_attention, online_softmax_init, online_softmax_step
from pallas_kernels.mla_absorb import absorb_query_pallas, absorb_refusal, absorb_value_pallas
from pallas_kernels.mla_decode import mla_decode_pallas
from pallas_kernels.mla_decode.hopper import (MERGES, TILE_ROWS, HopperMLABlocks, hopper_takes, mla_decode_hopper,
                                              mla_decode_hopper_splits)
from pallas_kernels.skinny import SkinnyImpl, resolve_skinny_impl

# Attention over the latent cache (steps with history): "absorbed" (pure JAX, W_UK folded into
# the query), "naive" (keys and values expanded per head: the reference), "pallas" (the
# flash-decoding kernel over the cache, Triton lowering; interpret mode off the GPU) or "hopper"
# (the Mosaic GPU kernel: warpgroup MMAs, TMA; on a GPU with a bf16/fp16 cache whose sizes it
# takes, else the "pallas" form). Around the two kernel forms, W_UK and W_UV are applied either by
# einsums or by few-row kernels reading kv_b_proj's kernel in place (`absorb`: `absorb_kernels_take`).
MLADecodeImpl = Literal["absorbed", "naive", "pallas", "hopper"]
MLA_DECODE_IMPLS: tuple[str, ...] = get_args(MLADecodeImpl)

# Attention of a fresh prompt over its own tokens (no history): "flash" (blockwise online softmax in
# JAX, memory linear in T), "cudnn" (cuDNN's fused flash attention through jax.nn.dot_product_attention:
# NVIDIA GPUs, bf16/fp16, Hopper for the 192/128 query/value head widths), "auto" (cudnn where it
# takes the call, else flash) or "naive" (the reference: a [B, H, T, T] score matrix). Continuation
# chunks over a cache (`chunk_attention`) have a form of each: cudnn as history and chunk parts
# merged by their log-sum-exps, flash blockwise over the cache; auto picks as for fresh prompts.
# How the Hopper kernel's sequence splits merge where the few-row value kernel does not merge them
# (more than 16 query rows, e.g. B = 64 decode): "xla" (combine_splits, the reference), "pallas" (one
# launch), "auto" (pallas from hopper.PALLAS_MERGE_FROM_SPLITS splits on).
MLA_MERGE_IMPLS: tuple[str, ...] = MERGES

MLAPrefillImpl = Literal["auto", "cudnn", "flash", "naive"]
MLA_PREFILL_IMPLS: tuple[str, ...] = get_args(MLAPrefillImpl)

# Calls with more new tokens per row than this over a cache with history are prefill chunks: they
# take `chunk_attention` (the prefill_impl form over the cache) instead of the decode kernel.
DECODE_MAX_QUERIES = 16

# The jax.nn.dot_product_attention implementation behind the "cudnn" forms ("xla" runs them anywhere:
# the CPU tests of the wiring set it).
FUSED_ATTENTION = "cudnn"

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


def _heads_k(k_nope_BSHN, k_pe_BSP):
    """Per-head keys with the shared rope part appended: [B, S, H, nope + rope]."""
    b, s, h, _ = k_nope_BSHN.shape
    return jnp.concatenate([k_nope_BSHN, jnp.broadcast_to(k_pe_BSP[:, :, None], (b, s, h, k_pe_BSP.shape[-1]))], -1)


def _heads_qk(q_nope_BTHN, q_pe_BTHP, k_nope_BTHN, k_pe_BTP):
    """Per-head queries and keys with the rope part appended: [B, T, H, nope + rope] each."""
    return jnp.concatenate([q_nope_BTHN, q_pe_BTHP], -1), _heads_k(k_nope_BTHN, k_pe_BTP)


def _fused(q, k, values, *, scale: float, v_dim: int, implementation: str, **kw):
    """jax.nn.dot_product_attention on [B, T, H, *] parts with the log-sum-exp of each query's scores
    -> (out [B, T, H, V], lse [B, T, H] fp32). The public API takes one head width for queries, keys
    and values: the narrower side is zero-padded (zero key columns add nothing to a score; zero
    value columns are cut from the output)."""
    width = max(q.shape[-1], v_dim)
    widen = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
    out, lse = jax.nn.dot_product_attention(widen(q), widen(k), widen(values), scale=scale, return_residual=True,
                                            implementation=implementation, **kw)
    return out[..., :v_dim], lse.astype(jnp.float32)


def _rotated_self_attention(q, k, values, valid_BT, *, scale: float, v_dim: int, implementation: str):
    """Causal attention of T tokens per row over themselves, rows left-padded: each row is rotated to
    lead with its real tokens (fused kernels mask padding at the END of a row), attended with
    sequence lengths, and rotated back -> (out [B, T, H, V], lse [B, T, H]); padding queries' rows
    are garbage (the caller masks them). A row all padding (a chunk before its prompt starts)
    attends one padding token rather than an empty sequence."""
    t = valid_BT.shape[1]
    pad_B = t - jnp.sum(valid_BT, axis=1).astype(jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    rotate = lambda x, idx: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    first = (pos + pad_B[:, None]) % t                         # each row's real tokens first
    q, k, values = rotate(q, first), rotate(k, first), rotate(values, first)
    lengths = jnp.maximum(t - pad_B, 1).astype(jnp.int32)
    out, lse = _fused(q, k, values, scale=scale, v_dim=v_dim, implementation=implementation, is_causal=True,
                      query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    back = (pos - pad_B[:, None]) % t
    return rotate(out, back), rotate(lse, back)


def attention_cudnn(q_nope_BTHN, q_pe_BTHP, latent_BTL, w_kv_b, valid_BT, *, scale: float, v_dim: int,
                    implementation: str | None = None):
    """Causal attention of T fresh tokens over themselves through cuDNN's fused flash attention.

    cuDNN masks padding at the END of a row (sequence lengths), so each left-padded row is rotated
    to start with its real tokens, attended, and rotated back; padding queries get zeros. Raises
    (at trace time) where cuDNN cannot take the call: no NVIDIA GPU, fp32, head widths it lacks.
    `implementation` (default FUSED_ATTENTION): "xla" runs the same rotation and masking anywhere.
    -> [B, T, H, V] in the latent dtype.
    """
    k_nope, k_pe, values = expand_kv(latent_BTL, w_kv_b, *q_nope_BTHN.shape[2:], v_dim)
    q, k = _heads_qk(q_nope_BTHN.astype(k_nope.dtype), q_pe_BTHP.astype(k_nope.dtype), k_nope, k_pe)
    out, _ = _rotated_self_attention(q, k, values, valid_BT, scale=scale, v_dim=v_dim,
                                     implementation=implementation or FUSED_ATTENTION)
    return jnp.where(valid_BT[:, :, None, None], out, 0).astype(latent_BTL.dtype)


def attention_cudnn_cache(q_nope_BTHN, q_pe_BTHP, latent_BTL, cache_BSL, w_kv_b, valid_BT, start_B, *, scale: float,
                          v_dim: int, implementation: str | None = None):
    """A continuation chunk through cuDNN's fused attention in two parts merged by their log-sum-exps:
    the chunk's queries over each row's history (slots [0, start), no causal mask, keys expanded per
    head from the cache) and over the chunk itself (causal, as `attention_cudnn`).

    Args:
      q_nope_BTHN, q_pe_BTHP: per-head query parts. latent_BTL: [B, T, R + P] this chunk's latents.
      cache_BSL: [B, S, R + P] the latent cache (slots >= start are not read). w_kv_b: kv_b_proj kernel.
      valid_BT: [B, T] real tokens (left padding False). start_B: [B] int32 tokens of history per row.
    Returns:
      [B, T, H, V] in the latent dtype (padding queries get zeros).
    """
    h, n = q_nope_BTHN.shape[2:]
    dt = latent_BTL.dtype
    kw = dict(scale=scale, v_dim=v_dim, implementation=implementation or FUSED_ATTENTION)
    k_nope, k_pe, values = expand_kv(latent_BTL, w_kv_b, h, n, v_dim)
    q, k = _heads_qk(q_nope_BTHN.astype(dt), q_pe_BTHP.astype(dt), k_nope, k_pe)
    own, own_lse = _rotated_self_attention(q, k, values, valid_BT, **kw)
    slots = jnp.arange(cache_BSL.shape[1])
    history_BSL = jnp.where((slots[None, :] < start_B[:, None])[..., None], cache_BSL.astype(dt), 0)  # no stale NaN
    hk_nope, hk_pe, h_values = expand_kv(history_BSL, w_kv_b, h, n, v_dim)
    h_keys = _heads_k(hk_nope, hk_pe)
    history = jnp.maximum(start_B, 1).astype(jnp.int32)  # an empty history attends slot 0, weighted 0 below
    past, past_lse = _fused(q, h_keys, h_values, key_value_seq_lengths=history, **kw)
    past_lse = jnp.where((start_B > 0)[:, None, None], past_lse, -jnp.inf)
    top = jnp.maximum(own_lse, past_lse)
    w_own, w_past = jnp.exp(own_lse - top)[..., None], jnp.exp(past_lse - top)[..., None]
    out = (own.astype(jnp.float32) * w_own + past.astype(jnp.float32) * w_past) / (w_own + w_past)
    return jnp.where(valid_BT[:, :, None, None], out, 0).astype(dt)


def attention_flash_cache(q_nope_BTHN, q_pe_BTHP, cache_BSL, w_kv_b, last_slot_BT, *, scale: float, v_dim: int,
                          block_q: int = 4096, block_k: int = 512):
    """T query tokens per row over a latent cache that already holds them (a continuation chunk of a
    chunked prefill), blockwise with an online softmax. Each key block's latents are expanded per
    head inside the loop, so no per-head copy of the cache and no [T, S] buffer exists; query
    blocks visit only the key blocks up to their last visible slot. Slots past a row's last
    visible one are zeroed before use (a stale or poisoned cache cannot leak in).

    Args:
      q_nope_BTHN, q_pe_BTHP: per-head query parts. cache_BSL: [B, S, R + P] latents | k_pe.
      w_kv_b: kv_b_proj kernel [R, H * (nope + v)].
      last_slot_BT: [B, T] int32 the last slot each query sees (-1: none, a padding query).
    Returns:
      [B, T, H, V] in the query dtype (padding queries get zeros).
    """
    b, t, h, n = q_nope_BTHN.shape
    s, r = cache_BSL.shape[1], w_kv_b.shape[0]
    bq, bk = min(block_q, t), min(block_k, s)
    nq, nk = -(-t // bq), -(-s // bk)
    w_uk, w_uv = split_kv_b(w_kv_b, h, n, v_dim)
    pad_q = lambda x, fill=0: jnp.pad(x, [(0, 0), (0, nq * bq - t)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    q_nope, q_pe, last = pad_q(q_nope_BTHN), pad_q(q_pe_BTHP), pad_q(last_slot_BT, -1)
    cache = jnp.pad(cache_BSL, [(0, 0), (0, nk * bk - s), (0, 0)])
    row_last_B = last_slot_BT.max(axis=1)

    def query_block(i):
        q_blk = (lax.dynamic_slice_in_dim(q_nope, i * bq, bq, 1), lax.dynamic_slice_in_dim(q_pe, i * bq, bq, 1))
        last_BQ = lax.dynamic_slice_in_dim(last, i * bq, bq, 1)

        def key_block(j, carry):
            slots = j * bk + jnp.arange(bk)
            lat = lax.dynamic_slice_in_dim(cache, j * bk, bk, 1)
            lat = jnp.where((slots[None, :] <= row_last_B[:, None])[..., None], lat, 0)
            c_kv, k_pe = lat[..., :r], lat[..., r:]
            k_nope = jnp.einsum("bsr,rhn->bshn", c_kv, w_uk)
            values = jnp.einsum("bsr,rhv->bshv", c_kv, w_uv)
            visible_BQS = slots[None, None, :] <= last_BQ[:, :, None]
            return online_softmax_step(carry, q_blk, (k_nope, k_pe), values, visible_BQS, scale)

        trips = jnp.clip((last_BQ.max() + bk) // bk, 0, nk)  # key blocks up to the last visible slot
        _, l_BHQ, acc_BHQV = lax.fori_loop(0, trips, key_block, online_softmax_init(b, h, bq, v_dim))
        return acc_BHQV / jnp.where(l_BHQ > 0, l_BHQ, 1.0)[..., None]

    out_NBHQV = lax.map(query_block, jnp.arange(nq))
    out = out_NBHQV.transpose(1, 0, 3, 2, 4).reshape(b, nq * bq, h, v_dim)[:, :t]
    return out.astype(q_nope_BTHN.dtype)


def chunk_attention(impl: MLAPrefillImpl, q_nope_BTHN, q_pe_BTHP, cache_BSL, w_kv_b, last_slot_BT, *, scale: float,
                    v_dim: int, latent_BTL=None, start_B=None) -> jax.Array:
    """Attention of many new tokens per row over a cache that holds history and them (the
    continuation chunks of a chunked prefill; the one dispatch site of that case).

    "flash": blockwise over the cache (`attention_flash_cache`, memory linear in T and S); "cudnn":
    `attention_cudnn_cache` (needs latent_BTL, this call's latents, and start_B, the history per
    row; on the H200 it made a 128K-token prompt's chunked prefill 4x faster than flash); "auto":
    cudnn where it takes the call, else flash; "naive": the reference, a [B, H, T, S] score matrix
    over per-head keys. Args and result as `cache_attention`.
    """
    kw = dict(scale=scale, v_dim=v_dim)
    if impl == "auto":
        if _cudnn_may_take(cache_BSL.dtype) and latent_BTL is not None and start_B is not None:
            try:  # cuDNN's own checks (version, head widths, arch) run while tracing
                return attention_cudnn_cache(q_nope_BTHN, q_pe_BTHP, latent_BTL, cache_BSL, w_kv_b,
                                             last_slot_BT >= 0, start_B, **kw)
            except (NotImplementedError, ValueError, RuntimeError):
                pass
        impl = "flash"
    if impl == "cudnn":
        return attention_cudnn_cache(q_nope_BTHN, q_pe_BTHP, latent_BTL, cache_BSL, w_kv_b, last_slot_BT >= 0, start_B,
                                     **kw)
    if impl == "flash":
        return attention_flash_cache(q_nope_BTHN, q_pe_BTHP, cache_BSL, w_kv_b, last_slot_BT, **kw)
    if impl == "naive":
        return cache_attention("naive", q_nope_BTHN, q_pe_BTHP, cache_BSL, w_kv_b, last_slot_BT, **kw)
    raise ValueError(f"MLA prefill: unknown impl {impl!r}; expected one of {MLA_PREFILL_IMPLS}")


def _cudnn_may_take(dtype) -> bool:
    """cuDNN flash attention needs an NVIDIA GPU and 16-bit inputs."""
    return jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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
    if impl == "auto":
        impl = "cudnn" if _cudnn_may_take(latent_BTL.dtype) else "flash"
        if impl == "cudnn":
            try:  # cuDNN's own checks (version, head widths, arch) run while tracing
                return attention_cudnn(q_nope_BTHN, q_pe_BTHP, latent_BTL, w_kv_b, valid_BT, **kw)
            except (NotImplementedError, ValueError, RuntimeError):
                impl = "flash"
    if impl == "cudnn":
        return attention_cudnn(q_nope_BTHN, q_pe_BTHP, latent_BTL, w_kv_b, valid_BT, **kw)
    if impl == "flash":
        return attention_flash(q_nope_BTHN, q_pe_BTHP, latent_BTL, w_kv_b, valid_BT, **kw)
    if impl == "naive":
        idx = jnp.arange(valid_BT.shape[1])
        mask = valid_BT[:, None, :] & (idx[None, :, None] >= idx[None, None, :])
        return attention_naive(q_nope_BTHN, q_pe_BTHP, latent_BTL, w_kv_b, mask, **kw)
    raise ValueError(f"MLA prefill: unknown impl {impl!r}; expected one of {MLA_PREFILL_IMPLS}")


def cache_attention(impl: MLADecodeImpl, q_nope_BTHN, q_pe_BTHP, cache_BSL, w_kv_b, last_slot_BT, *, scale: float,
                    v_dim: int, absorb: SkinnyImpl = "auto", merge: str = "auto") -> jax.Array:
    """Attention of T query tokens per row over a latent cache (the one dispatch site of MLA decode).

    Args:
      q_nope_BTHN, q_pe_BTHP: per-head query parts. cache_BSL: [B, S, R + P] latents | k_pe.
      w_kv_b: kv_b_proj kernel [R, H * (nope + v)].
      last_slot_BT: [B, T] int32 the last slot each query sees (its own slot); the T queries of a
        row sit at consecutive slots.
      absorb: how the "pallas" and "hopper" forms apply W_UK and W_UV: "xla" (einsums), "pallas"
        (`absorb_queries` and the value kernel, where `absorb_kernels_take`), "auto" ("pallas" on a GPU).
      merge: how the Hopper kernel's splits merge where the value kernel does not merge them:
        "xla" (`combine_splits`), "pallas" (`merge_splits_pallas`) or "auto"; see MLA_MERGE_IMPLS.
    Returns:
      [B, T, H, V] in the query dtype.
    """
    if impl in ("pallas", "hopper"):
        b, t, h, n = q_nope_BTHN.shape
        r = w_kv_b.shape[0]
        if absorb_kernels_take(impl, absorb, b * t, r, n, v_dim):
            # Slices of one query (as the layer cuts them) merge back into it in XLA: no copy.
            q = jnp.concatenate([q_nope_BTHN, q_pe_BTHP], axis=-1).reshape(b * t, -1)
            rows = absorb_queries(impl, q, w_kv_b, cache_BSL, heads=h, tokens=t, nope=n, v_dim=v_dim)
            return absorbed_cache_attention(impl, rows, cache_BSL, w_kv_b, last_slot_BT, heads=h, nope=n, v_dim=v_dim,
                                            scale=scale, out_dtype=q_nope_BTHN.dtype)
        w_uk, w_uv = split_kv_b(w_kv_b, h, n, v_dim)
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope_BTHN, w_uk, preferred_element_type=jnp.float32)
        lengths = last_slot_BT[:, -1] + 1
        if _runs_hopper(impl, cache_BSL, r):
            kernel = functools.partial(mla_decode_hopper, blocks=HopperMLABlocks(merge=merge))
        else:
            kernel = mla_decode_pallas
        lat = kernel(q_lat.astype(cache_BSL.dtype), q_pe_BTHP, cache_BSL, lengths, scale=scale)
        return jnp.einsum("bthr,rhv->bthv", lat, w_uv.astype(jnp.float32)).astype(q_nope_BTHN.dtype)
    slots = jnp.arange(cache_BSL.shape[1])
    mask = slots[None, None, :] <= last_slot_BT[:, :, None]
    if impl == "absorbed":
        return attention_absorbed(q_nope_BTHN, q_pe_BTHP, cache_BSL, w_kv_b, mask, scale=scale, v_dim=v_dim)
    if impl == "naive":
        return attention_naive(q_nope_BTHN, q_pe_BTHP, cache_BSL, w_kv_b, mask, scale=scale, v_dim=v_dim)
    raise ValueError(f"MLA decode: unknown impl {impl!r}; expected one of {MLA_DECODE_IMPLS}")


def _runs_hopper(impl: MLADecodeImpl, cache_BSL, latent_dim: int) -> bool:
    """Whether the "hopper" form runs the Mosaic GPU kernel (else the "pallas" form stands in)."""
    return (impl == "hopper" and jax.default_backend() == "gpu"
            and hopper_takes(cache_BSL.shape, cache_BSL.dtype, latent_dim))


def absorb_kernels_take(impl: MLADecodeImpl, absorb: SkinnyImpl, rows: int, latent_dim: int, nope: int,
                        v_dim: int) -> bool:
    """Whether decode attention of `rows` query tokens (B * T) applies W_UK and W_UV with the few-row
    kernels (`pallas_kernels.mla_absorb`): a kernel form ("pallas", "hopper"), `absorb` resolving to
    "pallas" and sizes the kernels take (at most 16 rows)."""
    return (impl in ("pallas", "hopper") and resolve_skinny_impl(absorb) == "pallas"
            and absorb_refusal(rows, latent_dim, nope, v_dim) is None)


def absorb_queries(impl: MLADecodeImpl, q_MC, w_kv_b, cache_BSL, *, heads: int, tokens: int, nope: int, v_dim: int,
                   q_col: int = 0, kv_MC=None, kv_col: int = 0, norm_weight=None, eps: float = 1e-6, slots_M=None):
    """The queries of `absorbed_cache_attention` (W_UK folded in, the rope part beside it) in the layout
    its kernel reads, in one launch; optionally with the new latents normalised (kv_a_layernorm).

    Args:
      q_MC: [B * T, C] rows holding each head's [nope | rope] query from column q_col (read in place).
      kv_MC, kv_col, norm_weight, eps: optional rows holding [c_kv | k_pe] from column kv_col and the
        kv_a_layernorm weight and eps.
      slots_M: optional, with kv_MC: each query row's cache slot ([M] int32, -1 for padding): the
        latents are written into the cache by the same launch instead of being returned.
    Returns:
      rows [B * T_pad, H, R + P] in the cache dtype (and the latents [B * T, R + P] in kv's dtype, or
      with slots_M the updated cache).
    """
    r = w_kv_b.shape[0]
    rope = cache_BSL.shape[2] - r
    multiple = TILE_ROWS if _runs_hopper(impl, cache_BSL, r) else 1   # whole Hopper query tiles, no padding copy
    return absorb_query_pallas(q_MC, w_kv_b, heads=heads, tokens=tokens, nope=nope, rope=rope, v_dim=v_dim,
                               q_col=q_col, multiple=multiple, out_dtype=cache_BSL.dtype, kv=kv_MC, kv_col=kv_col,
                               norm_weight=norm_weight, eps=eps, cache=None if slots_M is None else cache_BSL,
                               slots=slots_M)


def absorbed_cache_attention(impl: MLADecodeImpl, rows, cache_BSL, w_kv_b, last_slot_BT, *, heads: int, nope: int,
                             v_dim: int, scale: float, out_dtype) -> jax.Array:
    """`cache_attention`'s "pallas" / "hopper" forms on queries from `absorb_queries`, with W_UV applied
    by the few-row value kernel. On the Hopper kernel that kernel also merges the sequence splits.

    Args:
      rows: [B * T_pad, H, R + P] from `absorb_queries` (same impl and cache).
      cache_BSL, w_kv_b, last_slot_BT, scale: as `cache_attention`. out_dtype: the result's dtype.
    Returns:
      [B, T, H, V].
    """
    b, t = last_slot_BT.shape
    r = w_kv_b.shape[0]
    t_pad = rows.shape[0] // b
    lengths = last_slot_BT[:, -1] + 1
    kw = dict(heads=heads, tokens=t, nope=nope, v_dim=v_dim, out_dtype=out_dtype)
    if _runs_hopper(impl, cache_BSL, r):
        o, lse = mla_decode_hopper_splits(rows.reshape(b, t_pad * heads, -1), cache_BSL, lengths, heads=heads, sq=t,
                                          latent_dim=r, scale=scale)
        out = absorb_value_pallas(o, w_kv_b, lse=lse, **kw)
    else:
        q = rows.reshape(b, t_pad, heads, -1)[:, :t]
        lat = mla_decode_pallas(q[..., :r], q[..., r:], cache_BSL, lengths, scale=scale)
        out = absorb_value_pallas(lat.reshape(b * t, heads, r), w_kv_b, **kw)
    return out.reshape(b, t, heads, v_dim)
