"""Gated MLP (dense layers and shared experts) and its activations (arch §6.1)."""

from __future__ import annotations

import jax
from flax import nnx

from k3jax.config import MLPConfig
from k3jax.layers.activation import gated_activation
from k3jax.layers.linear import Linear, linears
from pallas_kernels.skinny import SkinnyImpl


class MLP(nnx.Module):
    """down(act(gate(x), up(x))) with checkpoint names gate_proj / up_proj / down_proj."""

    def __init__(self, cfg: MLPConfig, *, dtype, rngs: nnx.Rngs, linear_impl: SkinnyImpl = "auto"):
        self.activation = cfg.activation
        d, f = cfg.hidden_size, cfg.intermediate_size
        lin = lambda i, o, axes: Linear(i, o, dtype=dtype, axes=axes, rngs=rngs, impl=linear_impl)
        self.gate_proj = lin(d, f, ("embed", "mlp"))
        self.up_proj = lin(d, f, ("embed", "mlp"))
        self.down_proj = lin(f, d, ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D]."""
        (gate, up), = linears([(x, [self.gate_proj, self.up_proj])])   # one launch on the few-row path
        return self.down_proj(gated_activation(gate, up, self.activation))
