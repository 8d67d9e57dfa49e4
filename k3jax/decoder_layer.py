"""One decoder layer: a mixer (KDA or MLA) and an FFN (dense MLP or MoE), each behind its pre-norm
(arch §2). The residual stream around them is the caller's: plain pre-norm sums (Kimi-Linear, the
MTP layers) in `__call__`, or K3's attention residuals (k3jax.model) through `mixer` / `ffn`.
"""

from __future__ import annotations

import jax
from flax import nnx

from k3jax.config import AttnResConfig, KDAConfig, MLAConfig, MLPConfig, MoEConfig
from k3jax.layers.attn_res import AttnResPoint
from k3jax.layers.kda import KimiDeltaAttention
from k3jax.layers.mla import MultiHeadLatentAttention
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import MoE
from k3jax.layers.norms import RMSNorm
from k3jax.state import SeqInfo
from pallas_kernels.rms_norm import NormImpl
from pallas_kernels.skinny import SkinnyImpl


class DecoderLayer(nnx.Module):
    """Mixer (KDA or MLA) and FFN (dense or MoE), each behind its pre-norm. With `attn_res`, the
    layer also owns its two AttnRes mixing points (pre-mixer and pre-FFN)."""

    def __init__(self, mixer: KDAConfig | MLAConfig, ffn: MLPConfig | MoEConfig, *, hidden_size: int,
                 eps: float, attn_res: AttnResConfig | None = None, dtype, rngs: nnx.Rngs,
                 linear_impl: SkinnyImpl = "auto", norm_impl: NormImpl = "auto"):
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype=dtype, rngs=rngs, impl=norm_impl)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype=dtype, rngs=rngs, impl=norm_impl)
        if isinstance(mixer, KDAConfig):
            self.self_attn = KimiDeltaAttention(mixer, dtype=dtype, rngs=rngs, linear_impl=linear_impl)
        else:
            self.self_attn = MultiHeadLatentAttention(mixer, dtype=dtype, rngs=rngs, linear_impl=linear_impl)
        if isinstance(ffn, MoEConfig):
            self.block_sparse_moe = MoE(ffn, dtype=dtype, rngs=rngs, linear_impl=linear_impl)
        else:
            self.mlp = MLP(ffn, dtype=dtype, rngs=rngs, linear_impl=linear_impl)
        if attn_res is not None:
            self.self_attention_res = AttnResPoint(hidden_size, attn_res.eps, dtype=dtype, rngs=rngs)
            self.mlp_res = AttnResPoint(hidden_size, attn_res.eps, dtype=dtype, rngs=rngs)

    def mixer(self, x_BTD, seq: SeqInfo, layer_state, *, fresh: bool):
        """Mixer behind its pre-norm: (delta [B, T, D], new layer state)."""
        with jax.named_scope("norm"):
            x_BTD = self.input_layernorm(x_BTD)
        return self.mixer_normed(x_BTD, seq, layer_state, fresh=fresh)

    def mixer_normed(self, x_BTD, seq: SeqInfo, layer_state, *, fresh: bool, partial: bool = False):
        """Mixer on an input already normed by input_layernorm: (delta, new layer state). partial:
        the delta may come back as a `SplitSum` (fp32 partial sums) for `residual.add_norm`."""
        with jax.named_scope(self.mixer_kind):
            return self.self_attn(x_BTD, seq, layer_state, fresh=fresh, partial=partial)

    def ffn(self, y_BTD: jax.Array) -> jax.Array:
        """FFN behind its pre-norm: delta [B, T, D]."""
        with jax.named_scope("norm"):
            y_BTD = self.post_attention_layernorm(y_BTD)
        return self.ffn_normed(y_BTD)

    def ffn_normed(self, y_BTD: jax.Array, *, partial: bool = False):
        """FFN on an input already normed by post_attention_layernorm: delta [B, T, D], or (partial)
        possibly a `SplitSum` for `residual.add_norm`."""
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(y_BTD, partial=partial)
        with jax.named_scope("dense_mlp"):
            return self.mlp(y_BTD)

    @property
    def mixer_kind(self) -> str:
        return "kda" if isinstance(self.self_attn, KimiDeltaAttention) else "mla"

    def __call__(self, h_BTD, seq: SeqInfo, layer_state, *, fresh: bool):
        """Plain pre-norm residual block (Kimi-Linear; K3's MTP layer)."""
        a, layer_state = self.mixer(h_BTD, seq, layer_state, fresh=fresh)
        h_BTD = h_BTD + a
        return h_BTD + self.ffn(h_BTD), layer_state
