"""Reference twin of the row RMSNorm: the model's order of operations in XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm_reference(x, weight, eps: float):
    """Same contract as `kernel.rms_norm_pallas`."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return (weight * y).astype(x.dtype)


def add_rms_norm_reference(h, parts, weight, eps: float, *, parts_axis: int = 0):
    """Same contract as `kernel.add_rms_norm_pallas`."""
    h = (h + jnp.sum(parts.astype(jnp.float32), axis=parts_axis).astype(h.dtype)).astype(h.dtype)
    return h, rms_norm_reference(h, weight, eps)
