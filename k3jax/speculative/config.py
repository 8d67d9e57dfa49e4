"""Speculative decoding settings (`Generator.generate(..., speculative=SpeculativeConfig(...))`,
`k3jax generate --speculative METHOD`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# Where drafts come from: "mtp" (the model's own MTP layer, chained), "ngram" (prompt lookup over
# the prompt and the text so far; any model) or "replay" (benchmarks: a recorded continuation
# with deliberate errors, for a controlled acceptance rate on random weights).
SpeculativeMethod = Literal["mtp", "ngram", "replay"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)

MAX_DRAFT_TOKENS = 16


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
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
        lo, hi = self.ngram_min, self.ngram_max
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (lo, hi)) or not 1 <= lo <= hi <= 64:
            raise ValueError(f"ngram_min and ngram_max must be integers with 1 <= ngram_min <= ngram_max <= 64, "
                             f"got {lo!r} and {hi!r}")
        object.__setattr__(self, "replay_tokens", tuple(tuple(int(t) for t in row) for row in self.replay_tokens))
        if self.method == "replay" and not self.replay_tokens:
            raise ValueError("speculative method 'replay' needs replay_tokens (one recorded continuation per row)")
        if not 0.0 <= self.replay_error_rate <= 1.0:
            raise ValueError(f"replay_error_rate must be in [0, 1], got {self.replay_error_rate!r}")

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
