"""The text model: embedding, decoder layers (KDA or MLA mixer, dense MLP or MoE FFN), final
norm and untied LM head (arch §2, §3.2). Module attribute paths mirror the checkpoint names
(`model.layers.{i}.self_attn.q_proj`, `lm_head`, ...).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import KDAConfig, MLAConfig, MLPConfig, ModelConfig, MoEConfig
from k3jax.layers.kda import KimiDeltaAttention
from k3jax.layers.linear import Embedding, Linear
from k3jax.layers.mla import MultiHeadLatentAttention
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import MoE
from k3jax.layers.norms import RMSNorm
from k3jax.state import DecodeState, SeqInfo


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: h += mixer(norm(h)); h += ffn(norm(h))."""

    def __init__(self, mixer: KDAConfig | MLAConfig, ffn: MLPConfig | MoEConfig, *, hidden_size: int,
                 eps: float, dtype, rngs: nnx.Rngs):
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

    def ffn(self, x_BTD: jax.Array) -> jax.Array:
        return self.block_sparse_moe(x_BTD) if hasattr(self, "block_sparse_moe") else self.mlp(x_BTD)

    def __call__(self, h_BTD, seq: SeqInfo, layer_state, *, fresh: bool):
        a, layer_state = self.self_attn(self.input_layernorm(h_BTD), seq, layer_state, fresh=fresh)
        h_BTD = h_BTD + a
        h_BTD = h_BTD + self.ffn(self.post_attention_layernorm(h_BTD))
        return h_BTD, layer_state


class KimiModel(nnx.Module):
    """Embedding + decoder layers + final norm (checkpoint prefix `model.`)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        layers = []
        for mixer, ffn in zip(cfg.mixers, cfg.ffns):
            layers.append(DecoderLayer(cfg.kda if mixer == "kda" else cfg.mla,
                                       cfg.moe if ffn == "moe" else cfg.mlp,
                                       hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs))
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, tokens_BT: jax.Array, seq: SeqInfo, state: DecodeState | None, *, fresh: bool):
        """Returns (pre-norm final hidden [B, T, D], new state or None)."""
        h = self.embed_tokens(tokens_BT)
        new_layers = []
        for i, layer in enumerate(self.layers):
            h, layer_state = layer(h, seq, None if state is None else state.layers[i], fresh=fresh)
            new_layers.append(layer_state)
        if state is None:
            return h, None
        lengths = state.lengths + jnp.sum(seq.valid, axis=1, dtype=jnp.int32)
        return h, DecodeState(layers=tuple(new_layers), lengths=lengths)


class KimiForCausalLM(nnx.Module):
    """`model` + untied `lm_head` (kernel [D, Vocab])."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.model = KimiModel(cfg, dtype=dtype, rngs=rngs)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, axes=("embed", "vocab"), rngs=rngs)

    def __call__(self, tokens_BT, seq: SeqInfo, state: DecodeState | None, *, fresh: bool):
        return self.model(tokens_BT, seq, state, fresh=fresh)

    def logits(self, hidden_BTD: jax.Array) -> jax.Array:
        """Pre-norm hidden [..., D] -> logits [..., Vocab] fp32 (final norm, then LM head)."""
        return self.lm_head(self.model.norm(hidden_BTD), out_dtype=jnp.float32)
