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
    f_b:      [R, H*K] second half of the low-rank decay-gate projection (the checkpoint layer's
              kernel as stored): the step computes f = f_a @ f_b itself (see KDADecodeInputs).
    g_b:      [R, H*K] second half of a low-rank output gate (Kimi-Linear: z = g_a @ g_b, the inputs
              then carry g_a), or None for a full-rank gate (K3: the inputs carry z itself).
    lower_bound: None for Kimi-Linear's -a*softplus(u) gate, else K3's lower_bound*sigmoid(a*u).
    norm_eps: output RMSNorm epsilon. scale: multiplier of the normalised q (default K^-1/2).
    """

    q_conv: jax.Array
    k_conv: jax.Array
    v_conv: jax.Array
    dt_bias: jax.Array
    a_log: jax.Array
    o_norm_w: jax.Array
    f_b: jax.Array
    g_b: jax.Array | None = None
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
    f_a:        [B, R] first half of the low-rank decay-gate projection (f_a(x)); the step forms the
                logits f = f_a @ weights.f_b [B, H, K] (fp32 products, rounded to x_qkv's dtype as
                a projection's output would be) before dt_bias.
    beta_logit: [B, H] delta-rule step size before the sigmoid.
    The output-gate logits, in one of two forms (the other field None):
    z:          [B, H, K] given (a full-rank gate, K3's g_proj(x); weights.g_b is None), or
    g_a:        [B, R] first half of a low-rank gate (Kimi-Linear's g_a(x)); the step forms
                z = g_a @ weights.g_b like f.
    With a token axis (`kda_decode_steps`) every field gets a T axis after B.
    """

    x_qkv: jax.Array
    f_a: jax.Array
    beta_logit: jax.Array
    z: jax.Array | None = None
    g_a: jax.Array | None = None

    @property
    def low_rank_gate(self) -> bool:
        """Whether the output gate comes as g_a (low-rank) rather than z."""
        return self.g_a is not None
