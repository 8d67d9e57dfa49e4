"""Gated-MLP activations (arch §6.1): SiLU for Kimi-Linear, SiTU with clipped branches for K3:
    silu(gate) * up     or     [b tanh(gate / b) sigmoid(gate)] * [bl tanh(up / bl)]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import jax

from k3jax.errors import require, require_choice
from pallas_kernels.moe_gmm import GluSpec, glu

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

    @property
    def glu_spec(self) -> GluSpec:
        """The same activation as the kernels' static description."""
        return GluSpec(self.kind, self.situ_beta, self.situ_linear_beta)


def gated_activation(gate: jax.Array, up: jax.Array, act: Activation) -> jax.Array:
    """act(gate, up) in gate's dtype (the formula lives in `pallas_kernels.moe_gmm.activation`,
    shared with the grouped-matmul kernel's epilogue)."""
    return glu(gate, up, act.glu_spec)
