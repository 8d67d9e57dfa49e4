"""Gated MLP (dense layers and shared experts) and its activations (arch §6.1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import Activation, MLPConfig
from k3jax.layers.linear import Linear


def gated_activation(gate: jax.Array, up: jax.Array, act: Activation) -> jax.Array:
    """act(gate, up), returned in gate's dtype.

    silu: silu(gate) * up.
    situ: [b * tanh(gate / b) * sigmoid(gate)] * [bl * tanh(up / bl)] in fp32 (K3; bl None leaves
    the up branch unclipped).
    """
    if act.kind == "silu":
        return jax.nn.silu(gate) * up
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    left = act.situ_beta * jnp.tanh(g / act.situ_beta) * jax.nn.sigmoid(g)
    right = u if act.situ_linear_beta is None else act.situ_linear_beta * jnp.tanh(u / act.situ_linear_beta)
    return (left * right).astype(gate.dtype)


class MLP(nnx.Module):
    """down(act(gate(x), up(x))) with checkpoint names gate_proj / up_proj / down_proj."""

    def __init__(self, cfg: MLPConfig, *, dtype, rngs: nnx.Rngs):
        self.activation = cfg.activation
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, dtype=dtype, axes=("embed", "mlp"), rngs=rngs)
        self.up_proj = Linear(d, f, dtype=dtype, axes=("embed", "mlp"), rngs=rngs)
        self.down_proj = Linear(f, d, dtype=dtype, axes=("mlp", "embed"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D]."""
        return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), self.activation))
