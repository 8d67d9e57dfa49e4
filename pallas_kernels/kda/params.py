"""Typed argument bundles of the KDA decode step (pytrees; the float settings are static)."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KDADecodeWeights:
    """One KDA layer's weights as the decode step reads them.

    q_conv, k_conv, v_conv: [W, H, K] fp32 short-conv taps of q, k and v (tap W-1 multiplies the
              current token; each a free reshape of the checkpoint's [W, P]).
    dt_bias:  [H, K] forget-gate bias.
    a_log:    fp32 log decay rates, [H, 1] per head, [1, K] per channel or [H, K]; the step uses
              a = exp(a_log), broadcast to [H, K] (inside the kernel, not as a separate op).
    o_norm_w: [K] output RMSNorm weight (shared by all heads).
    lower_bound: None for Kimi-Linear's -a*softplus(u) gate, else K3's lower_bound*sigmoid(a*u).
    norm_eps: output RMSNorm epsilon. scale: multiplier of the normalised q (default K^-1/2).
    """

    q_conv: jax.Array
    k_conv: jax.Array
    v_conv: jax.Array
    dt_bias: jax.Array
    a_log: jax.Array
    o_norm_w: jax.Array
    lower_bound: float | None = field(default=None, metadata=dict(static=True))
    norm_eps: float = field(default=1e-5, metadata=dict(static=True))
    scale: float | None = field(default=None, metadata=dict(static=True))

    @property
    def conv_taps(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(q_conv, k_conv, v_conv), in the order of x_qkv's axis 1."""
        return self.q_conv, self.k_conv, self.v_conv


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
