"""What generation returns (vLLM's shapes: a request output holding its completions)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    finish_reason: "stop" (eos, a stop id or a stop string), "length" or "abort" (interrupted).
    stop_reason: the stop string or token id that ended it, else None.
    logprobs: with SamplingParams(logprobs=k), per generated token {token id: log-probability}
      holding the sampled token and the k most likely ones; cumulative_logprob sums the sampled ones.
    """

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class GenerationResult:
    """One prompt's outcome: its completions (SamplingParams.n of them) in `outputs`; `token_ids`,
    `text` and `finish_reason` are the first completion's."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


@dataclass
class SpeculativeStats:
    """Speculative decoding over one call. steps: verify steps summed over completions. accepted:
    drafts accepted that reached the output (a stop token or the length limit inside an accepted
    run cuts the rest). acceptance_rate: per draft position i, the fraction of steps that kept
    draft i (and so every draft before it)."""

    method: str
    num_draft_tokens: int
    steps: int
    accepted: int
    acceptance_rate: list[float]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per verify step (accepted drafts plus the target's own token)."""
        return 1.0 + self.accepted / self.steps if self.steps else float("nan")


@dataclass
class GenerationTimings:
    """prefill_s: the prompts' prefill and each row's first token (time to first token). decode_s:
    the rest of the tokens. new_tokens: all generated tokens; first_tokens: those sampled with the
    prefill (one per row that generated any); steps: the longest row's token count."""

    prefill_s: float
    decode_s: float
    new_tokens: int
    steps: int
    speculative: SpeculativeStats | None = None
    first_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Tokens generated in the decode phase per second of it (the first tokens excluded)."""
        return (self.new_tokens - self.first_tokens) / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first, of the longest row: decode_s / (steps - 1)."""
        return self.decode_s / (self.steps - 1) if self.steps > 1 else float("nan")


@dataclass
class StreamChunk:
    """New tokens (and text) of one completion since the previous chunk. `index` is the prompt's
    position in the call, `completion` the completion's index within the prompt."""

    index: int
    token_ids: list[int]
    text: str | None
    completion: int = 0


@dataclass
class GenerationOutput:
    results: list[GenerationResult]
    timings: GenerationTimings
    buckets: dict = field(default_factory=dict)

    def __iter__(self):
        return iter(self.results)

    def __len__(self):
        return len(self.results)

    def __getitem__(self, i):
        return self.results[i]
