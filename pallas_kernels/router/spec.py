"""What the router computes (one small frozen config shared by the kernel and its twin)."""

from __future__ import annotations

from dataclasses import dataclass

SCORES = ("sigmoid", "softmax")


@dataclass(frozen=True)
class RouterSpec:
    """k experts per token by score + bias; the chosen experts' unbiased scores, renormalised to sum
    to one (+1e-20) when `renormalize`, times `scale`. `always`: that many more choices per token
    after the k, experts E, E + 1, .. (E = the routed experts) with weight 1: always-active
    (shared) experts that run as extra groups of the same expert kernels."""

    k: int
    score: str = "sigmoid"
    renormalize: bool = True
    scale: float = 1.0
    always: int = 0

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"router: unknown score function {self.score!r}; expected one of {SCORES}")
        if self.k < 1:
            raise ValueError(f"router: k must be >= 1, got {self.k}")
        if self.always < 0:
            raise ValueError(f"router: always must be >= 0, got {self.always}")
