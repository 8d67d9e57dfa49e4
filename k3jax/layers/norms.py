"""RMS norms: the plain residual-stream norm and the sigmoid-gated KDA output norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.params import ones, param
from pallas_kernels.kda import gated_rms_norm
from pallas_kernels.rms_norm import NormImpl, rms_norm


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """Weight-less RMS normalisation over the last axis, in fp32: x / sqrt(mean(x^2) + eps)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis. Normalises in fp32, casts back to the input dtype, then scales
    by the weight (the Hugging Face order, arch §3.1). `impl` "xla" is the reference; "pallas" /
    "auto" (on a GPU) run a few rows (decode) as one kernel launch (`pallas_kernels.rms_norm`)."""

    def __init__(self, features: int, eps: float, *, dtype, rngs: nnx.Rngs, axis_name: str = "norm",
                 impl: NormImpl = "xla"):
        self.eps = eps
        self.impl = impl
        self.weight = param(rngs, (features,), dtype, ones(), (axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., F] -> [..., F] in x's dtype."""
        if self.impl != "xla" and self.weight[...].dtype == x.dtype:
            return rms_norm(x, self.weight[...], self.eps, impl=self.impl)
        y = rms_normalize(x, self.eps).astype(x.dtype)
        return (self.weight[...] * y).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """KDA output norm: w * rmsnorm(o) * sigmoid(z), all in fp32; w [K] is shared by all heads."""

    def __init__(self, features: int, eps: float, *, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = param(rngs, (features,), jnp.float32, ones(), ("head_dim",))

    def __call__(self, o: jax.Array, z: jax.Array, out_dtype) -> jax.Array:
        """o, z: [..., K] -> [..., K] in `out_dtype`."""
        return gated_rms_norm(o, z, self.weight[...], self.eps).astype(out_dtype)
