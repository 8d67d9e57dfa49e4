"""The scalar math of a KDA step, written once and used by the layer, the pure-JAX forms and the
Pallas kernel bodies alike (every function here lowers inside a Pallas kernel).

    u = f + dt_bias, a = exp(A_log)
    Kimi-Linear:  g = -a * softplus(u)            (softplus returns u above 20, as torch does)
    K3:           g = lower_bound * sigmoid(a * u)
    q, k:         x / sqrt(sum x^2 + 1e-6)         (eps on the SUM, arch §10.11)
    output:       w * rmsnorm(o) * sigmoid(z)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


def log1p_by_log(x: jax.Array) -> jax.Array:
    """log(1 + x) from `log` alone, for backends without a log1p (Mosaic GPU): log(y) x / (y - 1) with
    y = 1 + x rounded, which cancels the rounding of y (within a few ulp of log1p), and x where y == 1."""
    y = 1.0 + x
    return jnp.where(y == 1.0, x, jnp.log(y) * (x / (y - 1.0)))


def softplus(u: jax.Array, log1p=jnp.log1p) -> jax.Array:
    """log(1 + e^u), and u itself above the threshold (torch's softplus, which HF's KDA uses)."""
    return jnp.where(u > SOFTPLUS_THRESHOLD, u, log1p(jnp.exp(jnp.minimum(u, SOFTPLUS_THRESHOLD))))


def forget_gate(u: jax.Array, a: jax.Array, lower_bound: float | None, log1p=jnp.log1p) -> jax.Array:
    """Log-space per-channel decay g (<= 0) from u = f + dt_bias and a = exp(A_log), fp32.

    `a` broadcasts against `u` (per head [H, 1] or per channel [K]). log1p: `log1p_by_log` where the
    backend has none.
    """
    u = u.astype(jnp.float32)
    if lower_bound is None:
        return -a * softplus(u, log1p)
    return lower_bound * jax.nn.sigmoid(a * u)


def l2_inverse_norm(x: jax.Array, axis: int = -1, keepdims: bool = True) -> jax.Array:
    """1 / sqrt(sum(x^2) + L2_EPS) over `axis`, in fp32 (x times it is `l2_normalize(x)`)."""
    x = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=keepdims) + L2_EPS)


def l2_normalize(x: jax.Array, axis: int = -1) -> jax.Array:
    """x / sqrt(sum(x^2) + L2_EPS) over `axis`, in fp32."""
    return x.astype(jnp.float32) * l2_inverse_norm(x, axis)


def gated_rms_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """The KDA output norm in fp32: weight * o / sqrt(mean(o^2) + eps) * sigmoid(z)."""
    o = o.astype(jnp.float32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=axis, keepdims=True) + eps) * weight.astype(jnp.float32)
    return o * jax.nn.sigmoid(z.astype(jnp.float32))
