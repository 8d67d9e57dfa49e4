"""Fresh random arguments of one KDA decode step, shared by the decode kernel tests."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.kda import KDADecodeInputs, KDADecodeWeights


def decode_inputs(rng, b, h, kd, width=4, dtype=jnp.bfloat16, lower_bound=None, a_shape=None, conv_dtype=None):
    """(KDADecodeInputs, KDADecodeWeights, conv_state [B, W-1, 3, H, K], fp32 state [B, H, K, K]). a_shape: of
    a_log, [H, K] by default ([H, 1] per head and [1, K] per channel in the models); conv_dtype: the conv state's
    (default the activations')."""
    r = lambda *shape, dt=jnp.float32, s=1.0: jnp.asarray(s * rng.standard_normal(shape), dt)
    inputs = KDADecodeInputs(x_qkv=r(b, 3, h, kd, dt=dtype), f=r(b, h, kd, dt=dtype), beta_logit=r(b, h, dt=dtype),
                             z=r(b, h, kd, dt=dtype))
    weights = KDADecodeWeights(q_conv=r(width, h, kd, s=0.5), k_conv=r(width, h, kd, s=0.5),
                               v_conv=r(width, h, kd, s=0.5), dt_bias=r(h, kd), a_log=r(*(a_shape or (h, kd))),
                               o_norm_w=r(kd), lower_bound=lower_bound)
    return inputs, weights, r(b, width - 1, 3, h, kd, dt=conv_dtype or dtype), r(b, h, kd, kd)
