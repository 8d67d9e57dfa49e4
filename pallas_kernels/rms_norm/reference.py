"""Reference twin of the row RMSNorm: the model's order of operations in XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm_reference(x, weight, eps: float):
    """Same contract as `kernel.rms_norm_pallas`."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return (weight * y).astype(x.dtype)
