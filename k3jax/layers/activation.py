"""Gated-MLP activations (arch §6.1): SiLU for Kimi-Linear, SiTU with clipped branches for K3."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from k3jax.errors import require, require_choice

ActivationKind = Literal["silu", "situ"]
ACTIVATIONS = get_args(ActivationKind)


@dataclass(frozen=True)
class Activation:
    """Gated-MLP activation: `silu(gate) * up`, or K3's SiTU with clipped branches."""

    kind: ActivationKind = "silu"
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None

    def __post_init__(self):
        require_choice(self.kind, ACTIVATIONS, "hidden_act")
        if self.kind == "situ":
            require(self.situ_beta > 0, "activation_situ_beta", f"must be > 0, got {self.situ_beta}")
            require(self.situ_linear_beta is None or self.situ_linear_beta > 0,
                    "activation_situ_linear_beta", f"must be > 0 or null, got {self.situ_linear_beta}")


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
