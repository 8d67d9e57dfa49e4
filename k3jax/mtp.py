"""MTP draft layer (K3, arch §7): predicts the token after next from the target's pre-norm final
hidden state and the next token's embedding.

    e = Embed(t), zeroed where position == 0
    x = eh_proj([enorm(e), hnorm(h_prev)])          (embedding half first)
    h = DecoderLayer(x)                             (plain pre-norm residual, no AttnRes)
    logits = shared_head.head(shared_head.norm(h))

Checkpoint names under `model.layers.{L + j}.`: enorm, hnorm, eh_proj, shared_head.norm,
shared_head.head, the decoder block's usual names, and optionally embed_tokens (first layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.linear import Embedding, Linear
from k3jax.layers.norms import RMSNorm
from k3jax.decoder_layer import DecoderLayer
from k3jax.state import SeqInfo


class SharedHead(nnx.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, *, dtype, rngs: nnx.Rngs,
                 linear_impl: str = "auto"):
        self.norm = RMSNorm(hidden_size, eps, dtype=dtype, rngs=rngs)
        self.head = Linear(hidden_size, vocab_size, dtype=dtype, axes=("embed", "vocab"), rngs=rngs, impl=linear_impl)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.head(self.norm(h), out_dtype=jnp.float32)


class MTPLayer(DecoderLayer):
    """MTP layer j (global layer index L + j)."""

    def __init__(self, cfg: ModelConfig, j: int, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg.mixer_config(cfg.mtp_mixers[j]), cfg.ffn_config(cfg.mtp_ffns[j]),
                         hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps, attn_res=None, dtype=dtype, rngs=rngs,
                         linear_impl=cfg.linear_impl, norm_impl=cfg.norm_impl)
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.eh_proj = Linear(2 * d, d, dtype=dtype, axes=("mtp_concat", "embed"), rngs=rngs, impl=cfg.linear_impl)
        self.shared_head = SharedHead(d, cfg.vocab_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs,
                                      linear_impl=cfg.linear_impl)
        if cfg.mtp_own_embedding and j == 0:
            self.embed_tokens = Embedding(cfg.vocab_size, d, dtype=dtype, rngs=rngs)

    def draft(self, h_prev_BTD, tokens_BT, positions_BT, embedding, seq: SeqInfo, layer_state, *, fresh: bool):
        """Returns (pre-norm MTP hidden [B, T, D] (the next draft step's h_prev), new layer state)."""
        e = jnp.take(embedding, tokens_BT, axis=0)
        e = jnp.where((positions_BT == 0)[..., None], jnp.zeros_like(e), e)
        x = self.eh_proj(jnp.concatenate([self.enorm(e), self.hnorm(h_prev_BTD.astype(e.dtype))], axis=-1))
        return self(x, seq, layer_state, fresh=fresh)
