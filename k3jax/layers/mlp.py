"""Gated MLP (dense layers and shared experts) and its activations (arch §6.1)."""

from __future__ import annotations

import jax
from flax import nnx

from k3jax.config import MLPConfig
from k3jax.layers.activation import gated_activation
from k3jax.layers.linear import Linear


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
