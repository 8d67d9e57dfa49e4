"""Typed argument bundles of the KDA decode step (pytrees; the float settings are static)."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KDADecodeWeights:
    """One KDA layer's weights as the decode step reads them.

    conv_w:   [W, 3, H, K] fp32 short-conv taps of q | k | v (tap W-1 multiplies the current token).
    dt_bias:  [H, K] forget-gate bias.
    a:        [H, K] exp(A_log), broadcast to channels.
    o_norm_w: [K] output RMSNorm weight (shared by all heads).
    lower_bound: None for Kimi-Linear's -a*softplus(u) gate, else K3's lower_bound*sigmoid(a*u).
    norm_eps: output RMSNorm epsilon. scale: multiplier of the normalised q (default K^-1/2).
    """

    conv_w: jax.Array
    dt_bias: jax.Array
    a: jax.Array
    o_norm_w: jax.Array
    lower_bound: float | None = field(default=None, metadata=dict(static=True))
    norm_eps: float = field(default=1e-5, metadata=dict(static=True))
    scale: float | None = field(default=None, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KDADecodeInputs:
    """This step's per-row inputs, all in the activation dtype.

    x_qkv:      [B, 3, H, K] pre-conv q | k | v projections of the new token.
    f:          [B, H, K] forget-gate logits before dt_bias (f_b(f_a(x))).
    beta_logit: [B, H] delta-rule step size before the sigmoid.
    z:          [B, H, K] output-gate logits.
    """

    x_qkv: jax.Array
    f: jax.Array
    beta_logit: jax.Array
    z: jax.Array
