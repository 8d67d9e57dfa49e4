"""The text model: embedding, decoder layers (KDA or MLA mixer, dense MLP or MoE FFN), the
residual stream (plain pre-norm, or K3's attention residuals), final norm and untied LM head
(arch §2, §3). Module attribute paths mirror the checkpoint names (`model.layers.{i}.self_attn`,
`lm_head`, ...); `k3jax.checkpoint.name_map` holds the exact mapping.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import AttnResConfig, KDAConfig, MLAConfig, MLPConfig, ModelConfig, MoEConfig
from k3jax.layers.attn_res import AttnResPoint
from k3jax.layers.kda import KimiDeltaAttention
from k3jax.layers.linear import Embedding, Linear
from k3jax.layers.mla import MultiHeadLatentAttention
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import MoE
from k3jax.layers.norms import RMSNorm
from k3jax.state import DecodeState, SeqInfo


class DecoderLayer(nnx.Module):
    """Mixer (KDA or MLA) and FFN (dense or MoE), each behind its pre-norm. With `attn_res`, the
    layer also owns its two AttnRes mixing points (pre-mixer and pre-FFN)."""

    def __init__(self, mixer: KDAConfig | MLAConfig, ffn: MLPConfig | MoEConfig, *, hidden_size: int,
                 eps: float, attn_res: AttnResConfig | None = None, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype=dtype, rngs=rngs)
        if isinstance(mixer, KDAConfig):
            self.self_attn = KimiDeltaAttention(mixer, dtype=dtype, rngs=rngs)
        else:
            self.self_attn = MultiHeadLatentAttention(mixer, dtype=dtype, rngs=rngs)
        if isinstance(ffn, MoEConfig):
            self.block_sparse_moe = MoE(ffn, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(ffn, dtype=dtype, rngs=rngs)
        if attn_res is not None:
            self.self_attention_res = AttnResPoint(hidden_size, attn_res.eps, dtype=dtype, rngs=rngs)
            self.mlp_res = AttnResPoint(hidden_size, attn_res.eps, dtype=dtype, rngs=rngs)

    def mixer(self, x_BTD, seq: SeqInfo, layer_state, *, fresh: bool):
        """Mixer on the normed input: (delta [B, T, D], new layer state)."""
        return self.self_attn(self.input_layernorm(x_BTD), seq, layer_state, fresh=fresh)

    def ffn(self, y_BTD: jax.Array) -> jax.Array:
        """FFN on the normed input: delta [B, T, D]."""
        y_BTD = self.post_attention_layernorm(y_BTD)
        return self.block_sparse_moe(y_BTD) if hasattr(self, "block_sparse_moe") else self.mlp(y_BTD)

    def __call__(self, h_BTD, seq: SeqInfo, layer_state, *, fresh: bool):
        """Plain pre-norm residual block (Kimi-Linear; K3's MTP layer)."""
        a, layer_state = self.mixer(h_BTD, seq, layer_state, fresh=fresh)
        h_BTD = h_BTD + a
        return h_BTD + self.ffn(h_BTD), layer_state


class KimiModel(nnx.Module):
    """Embedding + decoder layers (+ the output AttnRes point) + final norm (prefix `model.`)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.attn_res_cfg = cfg.attn_res
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        layers = []
        for mixer, ffn in zip(cfg.mixers, cfg.ffns):
            layers.append(DecoderLayer(cfg.kda if mixer == "kda" else cfg.mla, cfg.moe if ffn == "moe" else cfg.mlp,
                                       hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps, attn_res=cfg.attn_res,
                                       dtype=dtype, rngs=rngs))
        self.layers = nnx.List(layers)
        if cfg.attn_res is not None:
            self.output_attn_res = AttnResPoint(cfg.hidden_size, cfg.attn_res.eps, dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, tokens_BT: jax.Array, seq: SeqInfo, state: DecodeState | None, *, fresh: bool):
        """Returns (pre-norm final hidden [B, T, D], new state or None)."""
        h = self.embed_tokens(tokens_BT)
        states = list(state.layers) if state is not None else [None] * len(self.layers)
        if self.attn_res_cfg is None:
            for i, layer in enumerate(self.layers):
                h, states[i] = layer(h, seq, states[i], fresh=fresh)
        elif self.attn_res_cfg.impl == "buffer":
            h = self._attn_res_buffer(h, seq, states, fresh)
        else:
            h = self._attn_res_list(h, seq, states, fresh)
        if state is None:
            return h, None
        lengths = state.lengths + jnp.sum(seq.valid, axis=1, dtype=jnp.int32)
        return h, DecodeState(layers=tuple(states), lengths=lengths)

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
        from k3jax.mtp import MTPLayer

        self.config = cfg
        self.model = KimiModel(cfg, dtype=dtype, rngs=rngs)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, axes=("embed", "vocab"), rngs=rngs)
        self.mtp = nnx.List([MTPLayer(cfg, j, dtype=dtype, rngs=rngs) for j in range(cfg.num_mtp_layers)])

    def __call__(self, tokens_BT, seq: SeqInfo, state: DecodeState | None, *, fresh: bool):
        return self.model(tokens_BT, seq, state, fresh=fresh)

    def logits(self, hidden_BTD: jax.Array) -> jax.Array:
        """Pre-norm hidden [..., D] -> logits [..., Vocab] fp32 (final norm, then LM head)."""
        return self.lm_head(self.model.norm(hidden_BTD), out_dtype=jnp.float32)

    def mtp_embedding(self) -> jax.Array:
        """The table the MTP layers embed with: their own when the checkpoint has one, else the model's."""
        if len(self.mtp) and hasattr(self.mtp[0], "embed_tokens"):
            return self.mtp[0].embed_tokens.embedding[...]
        return self.model.embed_tokens.embedding[...]
