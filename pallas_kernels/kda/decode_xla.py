"""One fused KDA decode step in pure JAX (arch §4.7): the production path off the GPU and the
twin of the Pallas kernel in `decode.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda.gate import forget_gate, gated_rms_norm, l2_normalize
from pallas_kernels.kda.params import KDADecodeInputs, KDADecodeWeights

_HIGHEST = jax.lax.Precision.HIGHEST


def validate_decode_inputs(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array,
                           state: jax.Array) -> None:
    """Raises ValueError naming the first argument whose shape disagrees with x_qkv [B, 3, H, K]."""
    if inputs.x_qkv.ndim != 4 or inputs.x_qkv.shape[1] != 3:
        raise ValueError(f"kda_decode: x_qkv must be [B, 3, H, K], got {inputs.x_qkv.shape}")
    b, _, h, k = inputs.x_qkv.shape
    w = weights.q_conv.shape[0]
    expected = {"f": (inputs.f, (b, h, k)), "beta_logit": (inputs.beta_logit, (b, h)), "z": (inputs.z, (b, h, k)),
                "q_conv": (weights.q_conv, (w, h, k)), "k_conv": (weights.k_conv, (w, h, k)),
                "v_conv": (weights.v_conv, (w, h, k)), "dt_bias": (weights.dt_bias, (h, k)),
                "o_norm_w": (weights.o_norm_w, (k,)), "conv_state": (conv_state, (b, w - 1, 3, h, k)),
                "state": (state, (b, h, k, k))}
    for name, (arr, shape) in expected.items():
        if tuple(arr.shape) != shape:
            raise ValueError(f"kda_decode: {name} must have shape {shape}, got {tuple(arr.shape)}")
    if tuple(weights.a_log.shape) not in ((h, 1), (1, k), (h, k)):
        raise ValueError(f"kda_decode: a_log must have shape {(h, 1)}, {(1, k)} or {(h, k)}, "
                         f"got {tuple(weights.a_log.shape)}")


def decode_factors(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array):
    """What the delta rule of one token takes, per (row, head): the conv window + SiLU of q, k and v
    (rounded to the activation dtype), q and k L2-normalised (q times the scale), the decay e^g and beta.

    Returns:
      (q, k, v [B, H, K] fp32, decay [B, H, K] fp32, beta [B, H] fp32, new conv_state [B, W-1, 3, H, K])
    """
    x = inputs.x_qkv
    dtype, kd = x.dtype, x.shape[-1]
    scale = kd ** -0.5 if weights.scale is None else weights.scale
    window = jnp.concatenate([conv_state.astype(jnp.float32), x[:, None].astype(jnp.float32)], axis=1)
    q, k, v = (jax.nn.silu(jnp.einsum("bwhk,whk->bhk", window[:, :, i], taps.astype(jnp.float32),
                                      precision=_HIGHEST)).astype(dtype)
               for i, taps in enumerate(weights.conv_taps))
    g = forget_gate(inputs.f.astype(jnp.float32) + weights.dt_bias.astype(jnp.float32),
                    jnp.exp(weights.a_log.astype(jnp.float32)), weights.lower_bound)
    beta = jax.nn.sigmoid(inputs.beta_logit.astype(jnp.float32))
    new_conv = jnp.concatenate([conv_state[:, 1:], x[:, None].astype(conv_state.dtype)], axis=1)
    return l2_normalize(q) * scale, l2_normalize(k), v.astype(jnp.float32), jnp.exp(g), beta, new_conv


def kda_decode_xla(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array,
                   state: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row through conv + SiLU, q/k L2 norm, forget gate, beta, the delta rule and
    the sigmoid-gated output RMSNorm.

    Args:
      inputs: this token's projections (KDADecodeInputs). weights: the layer's KDADecodeWeights.
      conv_state: [B, W-1, 3, H, K] the previous W-1 pre-conv inputs (activation dtype).
      state: [B, H, K, V] recurrent state (K == V), fp32 or bf16: the math runs in fp32 and the new
        state is stored back in the state's dtype.
    Returns:
      (out [B, H, K] in x_qkv's dtype, new conv_state, new state [B, H, K, V] in state's dtype)
    """
    validate_decode_inputs(inputs, weights, conv_state, state)
    dtype = inputs.x_qkv.dtype
    q, k, v, decay, beta, new_conv = decode_factors(inputs, weights, conv_state)
    s = state.astype(jnp.float32) * decay[..., None]
    pred = jnp.einsum("bhk,bhkv->bhv", k, s, precision=_HIGHEST)
    s = s + k[..., :, None] * (beta[..., None] * (v - pred))[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", q, s, precision=_HIGHEST).astype(dtype)
    out = gated_rms_norm(o, inputs.z, weights.o_norm_w, weights.norm_eps).astype(dtype)
    return out, new_conv, s.astype(state.dtype)
