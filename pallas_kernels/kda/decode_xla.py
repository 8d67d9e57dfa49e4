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
                           state: jax.Array, *, steps: bool = False) -> None:
    """Raises ValueError naming the first argument whose shape disagrees with x_qkv [B, 3, H, K]
    ([B, T, 3, H, K] with `steps`), or a gate given in the wrong form (z without g_b, or g_a with
    it)."""
    name = "kda_decode_steps" if steps else "kda_decode"
    x = inputs.x_qkv
    if x.ndim != 4 + steps or x.shape[-3] != 3:
        raise ValueError(f"{name}: x_qkv must be {'[B, T, 3, H, K]' if steps else '[B, 3, H, K]'}, got {x.shape}")
    lead, (h, k) = x.shape[:1 + steps], x.shape[-2:]
    b, w, r = lead[0], weights.q_conv.shape[0], weights.f_b.shape[0]
    if (inputs.z is None) == (inputs.g_a is None):
        raise ValueError(f"{name}: give the output gate as exactly one of z (full rank) or g_a (low rank)")
    if inputs.low_rank_gate != (weights.g_b is not None):
        raise ValueError(f"{name}: a low-rank output gate needs both g_a (inputs) and g_b (weights); "
                         f"got g_a {'given' if inputs.low_rank_gate else 'None'}, "
                         f"g_b {'given' if weights.g_b is not None else 'None'}")
    if inputs.low_rank_gate:
        r_g = weights.g_b.shape[0]
        gate = {"g_a": (inputs.g_a, lead + (r_g,)), "g_b": (weights.g_b, (r_g, h * k))}
    else:
        gate = {"z": (inputs.z, lead + (h, k))}
    expected = {"f_a": (inputs.f_a, lead + (r,)), "f_b": (weights.f_b, (r, h * k)),
                "beta_logit": (inputs.beta_logit, lead + (h,)), **gate,
                "q_conv": (weights.q_conv, (w, h, k)), "k_conv": (weights.k_conv, (w, h, k)),
                "v_conv": (weights.v_conv, (w, h, k)), "dt_bias": (weights.dt_bias, (h, k)),
                "o_norm_w": (weights.o_norm_w, (k,)), "conv_state": (conv_state, (b, w - 1, 3, h, k)),
                "state": (state, (b, h, k, k))}
    for arg, (arr, shape) in expected.items():
        if tuple(arr.shape) != shape:
            raise ValueError(f"{name}: {arg} must have shape {shape}, got {tuple(arr.shape)}")
    if tuple(weights.a_log.shape) not in ((h, 1), (1, k), (h, k)):
        raise ValueError(f"{name}: a_log must have shape {(h, 1)}, {(1, k)} or {(h, k)}, "
                         f"got {tuple(weights.a_log.shape)}")


def low_rank_logits(a: jax.Array, b: jax.Array, heads: int, dtype) -> jax.Array:
    """a [..., R] @ b [R, H*K] as [..., H, K]: fp32 products of a (in b's dtype) and b, rounded to
    `dtype` (what a projection's output holds)."""
    y = jnp.einsum("...r,rp->...p", a.astype(b.dtype), b, preferred_element_type=jnp.float32, precision=_HIGHEST)
    return y.astype(dtype).reshape(a.shape[:-1] + (heads, b.shape[1] // heads))


def kda_decode_xla(inputs: KDADecodeInputs, weights: KDADecodeWeights, conv_state: jax.Array,
                   state: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row through the low-rank gate products (f = f_a @ f_b, and z = g_a @ g_b for
    a low-rank output gate), conv + SiLU, q/k L2 norm, forget gate, beta, the delta rule and the
    sigmoid-gated output RMSNorm.

    Args:
      inputs: this token's projections (KDADecodeInputs). weights: the layer's KDADecodeWeights.
      conv_state: [B, W-1, 3, H, K] the previous W-1 pre-conv inputs (activation dtype).
      state: [B, H, K, V] recurrent state (K == V), fp32 or bf16: the math runs in fp32 and the new
        state is stored back in the state's dtype.
    Returns:
      (out [B, H, K] in x_qkv's dtype, new conv_state, new state [B, H, K, V] in state's dtype)
    """
    validate_decode_inputs(inputs, weights, conv_state, state)
    x = inputs.x_qkv
    dtype, kd = x.dtype, x.shape[-1]
    scale = kd ** -0.5 if weights.scale is None else weights.scale
    window = jnp.concatenate([conv_state.astype(jnp.float32), x[:, None].astype(jnp.float32)], axis=1)
    q, k, v = (jax.nn.silu(jnp.einsum("bwhk,whk->bhk", window[:, :, i], taps.astype(jnp.float32),
                                      precision=_HIGHEST)).astype(dtype)
               for i, taps in enumerate(weights.conv_taps))
    q, k, v = l2_normalize(q) * scale, l2_normalize(k), v.astype(jnp.float32)
    f = low_rank_logits(inputs.f_a, weights.f_b, x.shape[2], dtype)
    z = low_rank_logits(inputs.g_a, weights.g_b, x.shape[2], dtype) if inputs.low_rank_gate else inputs.z
    g = forget_gate(f.astype(jnp.float32) + weights.dt_bias.astype(jnp.float32),
                    jnp.exp(weights.a_log.astype(jnp.float32)), weights.lower_bound)
    beta = jax.nn.sigmoid(inputs.beta_logit.astype(jnp.float32))
    s = state.astype(jnp.float32) * jnp.exp(g)[..., None]
    pred = jnp.einsum("bhk,bhkv->bhv", k, s, precision=_HIGHEST)
    s = s + k[..., :, None] * (beta[..., None] * (v - pred))[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", q, s, precision=_HIGHEST).astype(dtype)
    out = gated_rms_norm(o, z, weights.o_norm_w, weights.norm_eps).astype(dtype)
    new_conv = jnp.concatenate([conv_state[:, 1:], x[:, None].astype(conv_state.dtype)], axis=1)
    return out, new_conv, s.astype(state.dtype)
