"""OpenAI request bodies (the fields this server reads; unknown fields are ignored, as OpenAI's
clients send many) and their translation to k3jax SamplingParams."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from k3jax.sampling import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None            # vLLM extension
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    ignore_eos: bool = False                 # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling(self, *, max_tokens: int, logprobs: int | None, skip_special_tokens: bool = True) -> SamplingParams:
        """The k3jax SamplingParams; raises ValueError naming a bad value (answered with HTTP 400)."""
        stop = self.stop if self.stop is not None else ()
        return SamplingParams(
            max_tokens=max_tokens, n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed, stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            skip_special_tokens=skip_special_tokens)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def prompts_of(request: CompletionRequest) -> list[str | list[int]]:
    """A completion request's prompts: one string, one token list, or a list of either."""
    p = request.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        return [p]
    if isinstance(p, list) and p:
        return list(p)
    raise ValueError("prompt must be a non-empty string, token list, or list of those")
