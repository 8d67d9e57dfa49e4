"""Speculative decoding settings (`Generator.generate(..., speculative=SpeculativeConfig(...))`,
`k3jax generate --speculative METHOD`)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

# Where drafts come from: "mtp" (the model's own MTP layer, chained), "ngram" (prompt lookup over
# the prompt and the text so far; any model) or "replay" (benchmarks: a recorded continuation
# with deliberate errors, for a controlled acceptance rate on random weights).
SpeculativeMethod = Literal["mtp", "ngram", "replay"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)

MAX_DRAFT_TOKENS = 16


def _integer(value) -> int | None:
    """value as a Python int (numpy integers included), None for bools, floats and the rest."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: one of SPECULATIVE_METHODS. num_draft_tokens: drafts verified per step (k; the
    verify window is q = k + 1 tokens). ngram_min / ngram_max: suffix lengths prompt lookup tries
    (longest first). replay_tokens: for "replay", one recorded continuation per completion row;
    replay_error_rate: the chance that a replayed draft is deliberately wrong; replay_seed: its
    random stream."""

    method: SpeculativeMethod
    num_draft_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    replay_tokens: tuple[tuple[int, ...], ...] = ()
    replay_error_rate: float = 0.0
    replay_seed: int = 0

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        k = _integer(self.num_draft_tokens)
        if k is None or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], "
                             f"got {self.num_draft_tokens!r}")
        lo, hi = _integer(self.ngram_min), _integer(self.ngram_max)
        if lo is None or hi is None or not 1 <= lo <= hi <= 64:
            raise ValueError(f"ngram_min and ngram_max must be integers with 1 <= ngram_min <= ngram_max <= 64, "
                             f"got {self.ngram_min!r} and {self.ngram_max!r}")
        rows = []
        for r, row in enumerate(self.replay_tokens):
            ids = [_integer(t) for t in row]
            if any(t is None or t < 0 for t in ids):
                raise ValueError(f"replay_tokens row {r} must hold non-negative integer token ids")
            rows.append(tuple(ids))
        rate, seed = self.replay_error_rate, _integer(self.replay_seed)
        if isinstance(rate, bool) or not isinstance(rate, (int, float, np.floating, np.integer)) \
                or not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"replay_error_rate must be a number in [0, 1], got {rate!r}")
        if seed is None:
            raise ValueError(f"replay_seed must be an integer, got {self.replay_seed!r}")
        for name, value in (("num_draft_tokens", k), ("ngram_min", lo), ("ngram_max", hi),
                            ("replay_tokens", tuple(rows)), ("replay_error_rate", float(rate)), ("replay_seed", seed)):
            object.__setattr__(self, name, value)
        if self.method == "replay" and not self.replay_tokens:
            raise ValueError("speculative method 'replay' needs replay_tokens (one recorded continuation per row)")

    @property
    def window(self) -> int:
        """Tokens per row in one verify step (q = k + 1)."""
        return self.num_draft_tokens + 1

    @classmethod
    def parse(cls, text: str, num_draft_tokens: int = 3) -> "SpeculativeConfig":
        """'ngram' or 'mtp' (CLI form), with the number of drafts given separately."""
        if text == "replay":
            raise ValueError("speculative method 'replay' is for benchmarks (Python API only)")
        return cls(method=text, num_draft_tokens=num_draft_tokens)
