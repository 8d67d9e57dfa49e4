"""The text model: embedding, decoder layers (KDA or MLA mixer, dense MLP or MoE FFN), the
residual stream (plain pre-norm, or K3's attention residuals), final norm and untied LM head
(arch §2, §3). Module attribute paths mirror the checkpoint names (`model.layers.{i}.self_attn`,
`lm_head`, ...); `k3jax.checkpoint.name_map` holds the exact mapping.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.decoder_layer import DecoderLayer
from k3jax.layers.attn_res import AttnResPoint
from k3jax.layers.linear import Embedding, Linear
from k3jax.layers.norms import RMSNorm
from k3jax.layers.residual import add, add_norm
from k3jax.mtp import MTPLayer
from k3jax.state import DecodeState, KDAPending, SeqInfo


class KimiModel(nnx.Module):
    """Embedding + decoder layers (+ the output AttnRes point) + final norm (prefix `model.`)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.attn_res_cfg = cfg.attn_res
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        layers = []
        for mixer, ffn in zip(cfg.mixers, cfg.ffns):
            layers.append(DecoderLayer(cfg.mixer_config(mixer), cfg.ffn_config(ffn), hidden_size=cfg.hidden_size,
                                       eps=cfg.rms_norm_eps, attn_res=cfg.attn_res, dtype=dtype, rngs=rngs,
                                       linear_impl=cfg.linear_impl, norm_impl=cfg.norm_impl))
        self.layers = nnx.List(layers)
        if cfg.attn_res is not None:
            self.output_attn_res = AttnResPoint(cfg.hidden_size, cfg.attn_res.eps, dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs, impl=cfg.norm_impl)

    def __call__(self, tokens_BT: jax.Array, seq: SeqInfo, state: DecodeState | None, *, fresh: bool):
        """Returns (pre-norm final hidden [B, T, D], new state or None)."""
        with jax.named_scope("embed"):
            h = self.embed_tokens(tokens_BT)
        states = list(state.layers) if state is not None else [None] * len(self.layers)
        if self.attn_res_cfg is None:
            h = self._pre_norm_layers(h, seq, states, fresh)
        elif self.attn_res_cfg.impl == "buffer":
            h = self._attn_res_buffer(h, seq, states, fresh)
        else:
            h = self._attn_res_list(h, seq, states, fresh)
        if state is None:
            return h, None
        lengths = state.lengths + jnp.sum(seq.valid, axis=1, dtype=jnp.int32)
        return h, DecodeState(layers=tuple(states), lengths=lengths)

    def _pre_norm_layers(self, h, seq, states, fresh):
        """Plain pre-norm residual blocks (Kimi-Linear). Each residual add goes with the norm that
        reads its result (`residual.add_norm`); at decode the branch outputs arrive as fp32 partial
        sums that the add sums (XLA's add fusion, or inside the norm's launch with norm="fused")."""
        layers = self.layers
        with jax.named_scope("norm"):
            x = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            a, states[i] = layer.mixer_normed(x, seq, states[i], fresh=fresh, partial=True)
            with jax.named_scope("norm"):
                h, y = add_norm(h, a, layer.post_attention_layernorm)
            f = layer.ffn_normed(y, partial=i + 1 < len(layers))
            if i + 1 < len(layers):
                with jax.named_scope("norm"):
                    h, x = add_norm(h, f, layers[i + 1].input_layernorm)
            else:
                h = add(h, f)
        return h

    def _attn_res_buffer(self, emb, seq, states, fresh):
        """AttnRes with a fixed-size block buffer [NB, B, T, D] plus validity masks (arch §3.4, §3.6).

        Sources at every mixing point are the buffer's NB slots (the first `n` valid) plus the
        running partial sum `p`; at a boundary layer (i % block_size == 0) `p` is archived into
        slot i // block_size after the pre-mixer mix and restarts from the mixer output.
        """
        cfg, dtype = self.attn_res_cfg, emb.dtype
        nb = cfg.num_blocks(len(self.layers))
        blocks = jnp.zeros((nb,) + emb.shape, dtype)
        slots = jnp.arange(nb + 1)
        n, p = 0, emb

        def sources(partial):
            return jnp.concatenate([blocks, partial[None]], axis=0), (slots < n) | (slots == nb)

        for i, layer in enumerate(self.layers):
            x = p if n == 0 else layer.self_attention_res.mix(*sources(p), dtype)
            boundary = i % cfg.block_size == 0
            if boundary:
                blocks = blocks.at[i // cfg.block_size].set(p)
                n += 1
            a, states[i] = layer.mixer(x, seq, states[i], fresh=fresh)
            p = a if boundary else p + a
            y = layer.mlp_res.mix(*sources(p), dtype)
            p = p + layer.ffn(y)
        return self.output_attn_res.mix(*sources(p), dtype)

    def _attn_res_list(self, emb, seq, states, fresh):
        """Reference AttnRes with a growing Python list of blocks (arch §3.4, step by step)."""
        cfg, dtype = self.attn_res_cfg, emb.dtype
        blocks, p = [], emb
        for i, layer in enumerate(self.layers):
            x = p if not blocks else layer.self_attention_res.mix_list(blocks + [p], dtype)
            if i % cfg.block_size == 0:
                blocks.append(p)
                p = None
            a, states[i] = layer.mixer(x, seq, states[i], fresh=fresh)
            p = a if p is None else p + a
            p = p + layer.ffn(layer.mlp_res.mix_list(blocks + [p], dtype))
        return self.output_attn_res.mix_list(blocks + [p], dtype)


class KimiForCausalLM(nnx.Module):
    """`model` + untied `lm_head` (kernel [D, Vocab]) + optional MTP draft layers."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.model = KimiModel(cfg, dtype=dtype, rngs=rngs)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, axes=("embed", "vocab"), rngs=rngs,
                              impl=cfg.linear_impl)
        self.mtp = nnx.List([MTPLayer(cfg, j, dtype=dtype, rngs=rngs) for j in range(cfg.num_mtp_layers)])

    def __call__(self, tokens_BT, seq: SeqInfo, state: DecodeState | None, *, fresh: bool):
        return self.model(tokens_BT, seq, state, fresh=fresh)

    def logits(self, hidden_BTD: jax.Array) -> jax.Array:
        """Pre-norm hidden [..., D] -> logits [..., Vocab] fp32 (final norm, then LM head)."""
        with jax.named_scope("lm_head"):
            return self.lm_head(self.model.norm(hidden_BTD), out_dtype=jnp.float32)

    def commit(self, state: DecodeState, start_B: jax.Array, keep_B: jax.Array) -> DecodeState:
        """The state after keeping the first keep_B[b] tokens (0..Q) of a tentative window that
        started at start_B[b]: KDA layers replay them (`KimiDeltaAttention.commit`), MLA caches keep
        their slots and roll back by length."""
        layers = tuple(self.model.layers[i].self_attn.commit(s, keep_B) if isinstance(s, KDAPending) else s
                       for i, s in enumerate(state.layers))
        return DecodeState(layers=layers, lengths=(start_B + keep_B).astype(jnp.int32))

    def mtp_embedding(self) -> jax.Array:
        """The table the MTP layers embed with: their own when the checkpoint has one, else the model's."""
        if len(self.mtp) and hasattr(self.mtp[0], "embed_tokens"):
            return self.mtp[0].embed_tokens.embedding[...]
        return self.model.embed_tokens.embedding[...]


def abstract_model(cfg: ModelConfig, dtype) -> KimiForCausalLM:
    """The model's structure with `jax.ShapeDtypeStruct` leaves: no memory, no computation.
    Split it (`nnx.split`) for the graphdef and the parameter shapes and dtypes."""
    return nnx.eval_shape(lambda: KimiForCausalLM(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
