"""Fused KDA decode step as one Pallas kernel (Triton lowering): per (row, head) program, the conv
window update + SiLU, q/k L2 norm, forget gate, beta, delta-rule update of the fp32 [K, V] state
(in place) and the sigmoid-gated output RMSNorm. Twin: `reference.kda_decode_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret, is_pow2
from pallas_kernels.kda.tuning import DecodeBlocks


def _decode_kernel(x_ref, conv_ref, w_ref, f_ref, dt_ref, a_ref, b_ref, z_ref, nw_ref, s_ref,
                   out_ref, conv_out_ref, s_out_ref, *, width, lower_bound, norm_eps, scale):
    f32 = jnp.float32
    dtype = x_ref.dtype
    acts = []
    for i in range(3):  # q, k, v
        xi = x_ref[i, :]
        pre = w_ref[width - 1, i, :].astype(f32) * xi.astype(f32)
        for j in range(width - 1):
            hist = conv_ref[j, i, :]
            pre += w_ref[j, i, :].astype(f32) * hist.astype(f32)
            conv_out_ref[j, i, :] = conv_ref[j + 1, i, :] if j + 1 < width - 1 else xi
        act = pre * (1.0 / (1.0 + jnp.exp(-pre)))
        acts.append(act.astype(dtype).astype(f32))
    q, k, v = acts
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * scale
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)
    u = f_ref[...].astype(f32) + dt_ref[...].astype(f32)
    a = a_ref[...].astype(f32)
    if lower_bound is None:
        g = -a * jnp.where(u > 20.0, u, jnp.log(1.0 + jnp.exp(jnp.minimum(u, 20.0))))
    else:
        g = lower_bound / (1.0 + jnp.exp(-a * u))
    beta = 1.0 / (1.0 + jnp.exp(-b_ref[...].astype(f32)))
    s = s_ref[...] * jnp.exp(g)[:, None]                     # [K, V]
    pred = jnp.sum(s * k[:, None], axis=0)                   # [V]
    nu = beta * (v - pred)
    s = s + k[:, None] * nu[None, :]
    s_out_ref[...] = s
    o = jnp.sum(s * q[:, None], axis=0).astype(dtype).astype(f32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o) + norm_eps) * nw_ref[...].astype(f32)
    z = z_ref[...].astype(f32)
    out_ref[...] = (o / (1.0 + jnp.exp(-z))).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("lower_bound", "norm_eps", "scale", "blocks", "interpret"))
def kda_decode(x_qkv, conv_state, conv_w, f, dt_bias, a, beta_logit, z, o_norm_w, state, *, lower_bound=None,
               norm_eps=1e-5, scale=None, blocks: DecodeBlocks = DecodeBlocks(), interpret: bool | None = None):
    """Fused KDA decode step; same contract as `kda_decode_reference` (the state is updated in place)."""
    b, _, h, kd = x_qkv.shape
    width = conv_w.shape[0]
    if not is_pow2(kd) or state.shape != (b, h, kd, kd):
        raise ValueError(f"kda_decode: head dim must be a power of two with K == V, got x {x_qkv.shape}, "
                         f"state {state.shape}")
    scale = kd ** -0.5 if scale is None else scale
    interpret = default_interpret() if interpret is None else interpret
    kernel = functools.partial(_decode_kernel, width=width, lower_bound=lower_bound, norm_eps=norm_eps, scale=scale)
    row_head = lambda i, j: (i, j, 0)
    out, new_conv, new_state = pl.pallas_call(
        kernel,
        grid=(b, h),
        in_specs=[
            pl.BlockSpec((None, 3, None, kd), lambda i, j: (i, 0, j, 0)),             # x_qkv
            pl.BlockSpec((None, width - 1, 3, None, kd), lambda i, j: (i, 0, 0, j, 0)),  # conv_state
            pl.BlockSpec((width, 3, None, kd), lambda i, j: (0, 0, j, 0)),            # conv_w
            pl.BlockSpec((None, None, kd), row_head),                                 # f
            pl.BlockSpec((None, kd), lambda i, j: (j, 0)),                            # dt_bias
            pl.BlockSpec((None, kd), lambda i, j: (j, 0)),                            # a
            pl.BlockSpec((None, None), lambda i, j: (i, j)),                          # beta_logit
            pl.BlockSpec((None, None, kd), row_head),                                 # z
            pl.BlockSpec((kd,), lambda i, j: (0,)),                                   # o_norm_w
            pl.BlockSpec((None, None, kd, kd), lambda i, j: (i, j, 0, 0)),            # state
        ],
        out_specs=[
            pl.BlockSpec((None, None, kd), row_head),
            pl.BlockSpec((None, width - 1, 3, None, kd), lambda i, j: (i, 0, 0, j, 0)),
            pl.BlockSpec((None, None, kd, kd), lambda i, j: (i, j, 0, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, h, kd), x_qkv.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(state.shape, jnp.float32)],
        input_output_aliases={9: 2},
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode",
    )(x_qkv, conv_state, conv_w, f, dt_bias, a, beta_logit, z, o_norm_w, state.astype(jnp.float32))
    return out, new_conv, new_state
