"""NoPE multi-head latent attention layer (arch §5) with a per-row latent cache.

Checkpoint names under `self_attn.`: q_proj (Kimi-Linear) or q_a_proj + q_a_layernorm + q_b_proj
(K3), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, g_proj (K3 output gate), o_proj.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import MLAConfig
from k3jax.layers.linear import Linear, linears, takes_fused_kernel
from k3jax.layers.mla_attention import (DECODE_MAX_QUERIES, absorb_kernels_take, absorb_queries,
                                        absorbed_cache_attention, cache_attention, chunk_attention, prefill_attention)
from k3jax.layers.norms import RMSNorm
from k3jax.state import MLACache, SeqInfo
from pallas_kernels.skinny import SkinnyImpl


def write_cache(latent_BSL: jax.Array, new_BTL: jax.Array, seq: SeqInfo) -> jax.Array:
    """Writes each row's real tokens at slots start + t - pad; padding and overflow are dropped."""
    b, s, _ = latent_BSL.shape
    slots = seq.slot_index()
    slots = jnp.where(slots < 0, s, slots)
    rows = jnp.arange(b)[:, None]
    return latent_BSL.at[rows, slots].set(new_BTL.astype(latent_BSL.dtype), mode="drop")


class MultiHeadLatentAttention(nnx.Module):
    """MLA mixer. x [B, T, D] (the normed layer input) -> [B, T, D].

    `cfg.absorb_impl` picks the few-row kernels of the "pallas" / "hopper" decode forms
    (`mla_attention.absorb_kernels_take`): W_UK with the new latents' kv_a_layernorm in one launch,
    W_UV with the merge of the attention kernel's splits in another; "xla" keeps the einsums.
    """

    def __init__(self, cfg: MLAConfig, *, dtype, rngs: nnx.Rngs, linear_impl: SkinnyImpl = "auto"):
        self.cfg = cfg
        self.absorb_impl = cfg.absorb_impl
        d, h = cfg.hidden_size, cfg.num_heads
        lin = lambda i, o, axes: Linear(i, o, dtype=dtype, axes=axes, rngs=rngs, impl=linear_impl)
        if cfg.q_lora_rank is None:
            self.q_proj = lin(d, h * cfg.qk_head_dim, ("embed", "mla_q"))
        else:
            self.q_a_proj = lin(d, cfg.q_lora_rank, ("embed", "q_lora"))
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps, dtype=dtype, rngs=rngs)
            self.q_b_proj = lin(cfg.q_lora_rank, h * cfg.qk_head_dim, ("q_lora", "mla_q"))
        self.kv_a_proj_with_mqa = lin(d, cfg.latent_size, ("embed", "kv_latent"))
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps, dtype=dtype, rngs=rngs)
        self.kv_b_proj = lin(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), ("kv_lora", "mla_kv"))
        if cfg.use_output_gate:
            self.g_proj = lin(d, h * cfg.v_head_dim, ("embed", "mla_o"))
        self.o_proj = lin(h * cfg.v_head_dim, d, ("mla_o", "embed"))

    def __call__(self, x_BTD: jax.Array, seq: SeqInfo, cache: MLACache | None, *, fresh: bool,
                 partial: bool = False):
        """Returns (out [B, T, D], updated cache or None). partial: out may be o_proj's fp32 partial
        sums (`Linear(partial=True)`) for the residual add to sum.

        fresh=True means no row has history: attention runs over this call's tokens with the
        `prefill_impl` form.
        Otherwise the new latents are written first and attention reads the whole cache: with the
        `decode_impl` form for up to DECODE_MAX_QUERIES tokens per row (decode steps, verify
        windows), else with the `prefill_impl` form (continuation chunks of a chunked prefill);
        query token t of row b sits at slot start + t - pad.
        """
        cfg = self.cfg
        b, t, _ = x_BTD.shape
        h = cfg.num_heads
        # Everything that reads x in one launch on the few-row (decode) path.
        first = [self.q_proj if cfg.q_lora_rank is None else self.q_a_proj, self.kv_a_proj_with_mqa]
        groups = [(x_BTD, first + ([self.g_proj] if cfg.use_output_gate else []))]
        first_outs, = linears(groups)
        q, kv, *gate_logits = first_outs
        if cfg.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.reshape(b, t, h, cfg.qk_head_dim)
        w_kv_b = self.kv_b_proj.kernel[...]
        kwargs = dict(scale=cfg.scale, v_dim=cfg.v_head_dim)
        decode = cache is not None and not fresh and t <= DECODE_MAX_QUERIES

        if decode and absorb_kernels_take(cfg.decode_impl, self.absorb_impl, b * t, cfg.kv_lora_rank,
                                          cfg.qk_nope_head_dim, cfg.v_head_dim):
            attn, cache = self._absorbed_decode(q, kv, first_outs, takes_fused_kernel(groups), w_kv_b, seq, cache)
        else:
            q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
            latent = jnp.concatenate([self.kv_a_layernorm(kv[..., :cfg.kv_lora_rank]), kv[..., cfg.kv_lora_rank:]],
                                     axis=-1)
            if cache is None or fresh:
                attn = prefill_attention(cfg.prefill_impl, q_nope, q_pe, latent, w_kv_b, seq.valid, **kwargs)
                if cache is not None:
                    cache = MLACache(latent=write_cache(cache.latent, latent, seq))
            else:
                cache = MLACache(latent=write_cache(cache.latent, latent, seq))
                if decode:
                    attn = cache_attention(cfg.decode_impl, q_nope, q_pe, cache.latent, w_kv_b, seq.slot_index(),
                                           absorb="xla", merge=cfg.merge_impl, **kwargs)
                else:
                    attn = chunk_attention(cfg.prefill_impl, q_nope, q_pe, cache.latent, w_kv_b, seq.slot_index(),
                                           latent_BTL=latent, start_B=seq.start, **kwargs)
        attn = attn.reshape(b, t, h * cfg.v_head_dim)
        if cfg.use_output_gate:  # K3: sigmoid gate from the layer input on the concatenated heads
            gate = jax.nn.sigmoid(gate_logits[0].astype(jnp.float32))
            attn = attn.astype(jnp.float32) * gate
        return self.o_proj(attn.astype(x_BTD.dtype), partial=partial), cache

    def _absorbed_decode(self, q_BTHD, kv_BTL, first_outs, fused: bool, w_kv_b, seq: SeqInfo, cache: MLACache):
        """Decode attention through the few-row kernels: the absorbed queries and the normalised new
        latents written into the cache at their slots by one launch that reads the projections' output
        where it lies, then `absorbed_cache_attention`. -> (attn [B, T, H, V], cache)."""
        cfg = self.cfg
        b, t, h, _ = q_BTHD.shape
        m = b * t
        q_src, q_col = q_BTHD.reshape(m, -1), 0
        kv_src, kv_col = kv_BTL.reshape(m, -1), 0
        if fused:   # the input launch's outputs side by side are its one output: XLA merges the slices back
            kv_src = jnp.concatenate([o.reshape(m, -1) for o in first_outs], axis=-1)
            kv_col = first_outs[0].shape[-1]
            if cfg.q_lora_rank is None:
                q_src = kv_src
        rows, latent_cache = absorb_queries(cfg.decode_impl, q_src, w_kv_b, cache.latent, heads=h, tokens=t,
                                            nope=cfg.qk_nope_head_dim, v_dim=cfg.v_head_dim, q_col=q_col,
                                            kv_MC=kv_src, kv_col=kv_col, norm_weight=self.kv_a_layernorm.weight[...],
                                            eps=self.kv_a_layernorm.eps, slots_M=seq.slot_index().reshape(m))
        cache = MLACache(latent=latent_cache)   # the new latents written at their slots by the same launch
        attn = absorbed_cache_attention(cfg.decode_impl, rows, cache.latent, w_kv_b, seq.slot_index(), heads=h,
                                        nope=cfg.qk_nope_head_dim, v_dim=cfg.v_head_dim, scale=cfg.scale,
                                        out_dtype=q_BTHD.dtype)
        return attn, cache
