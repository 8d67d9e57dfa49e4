"""The gated activation of expert MLPs, written once for the model and the kernel epilogues.

    silu:  silu(gate) * up
    situ:  [b * tanh(gate / b) * sigmoid(gate)] * [bl * tanh(up / bl)]   (K3's SiTU, arch §6.1;
           in fp32; bl None leaves the up branch unclipped)
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class GluSpec:
    """Which gated activation: kind "silu" or "situ", with SiTU's clip scales."""

    kind: str = "silu"
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None


def glu(gate: jax.Array, up: jax.Array, spec: GluSpec) -> jax.Array:
    """act(gate, up) in gate's dtype (SiTU computed in fp32)."""
    if spec.kind == "silu":
        return jax.nn.silu(gate) * up
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    left = spec.situ_beta * jnp.tanh(g / spec.situ_beta) * jax.nn.sigmoid(g)
    right = u if spec.situ_linear_beta is None else spec.situ_linear_beta * jnp.tanh(u / spec.situ_linear_beta)
    return (left * right).astype(gate.dtype)
