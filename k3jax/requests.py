"""Request preparation shared by the static generator (k3jax.generate) and the continuous-batching
engine (k3jax.engine): prompt encoding and checks, one batch row per completion, the per-row
sampling arrays, and the CompletionOutput of a finished row."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from k3jax.chat import encode_chat
from k3jax.decode_loop import LENGTH, STOPPED
from k3jax.outputs import CompletionOutput
from k3jax.sampling import SamplerInputs, SamplingParams
from k3jax.stop_strings import StopMatch, decode_text, device_stop_ids, find_stop


def is_message_list(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


def encode_prompt(model, tokenizer, prompt, *, chat_options: dict | None = None) -> list[int]:
    """str -> text tokens; list of message dicts -> chat-rendered tokens; list of ints -> as given.
    Raises ValueError naming what is wrong with the prompt."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer (pass token ids, or a model directory with tiktoken.model)")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, dict):
        raise ValueError("a chat prompt is a list of message dicts, got a single dict (wrap it in a list)")
    elif is_message_list(prompt):
        if tokenizer is None:
            raise ValueError("chat prompts need a tokenizer")
        ids = encode_chat(prompt, tokenizer, family=model.config.model_type, **(chat_options or {}))
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
            raise ValueError(f"a token-id prompt must be one-dimensional, got shape {prompt.shape}")
        ids = list(prompt)
        # Checked per distinct element type, not per element: a long prompt's check costs microseconds.
        types = set(map(type, ids))
        if not all(issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_)) for t in types):
            raise ValueError("a token-id prompt must be a flat list of integers")
    else:
        raise ValueError(f"a prompt must be a str, a list of message dicts or a list of token ids, "
                         f"got {type(prompt).__name__}")
    if not ids:
        raise ValueError("empty prompt")
    vocab = model.config.vocab_size
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        arr = None
    if arr is None or arr.min() < 0 or arr.max() >= vocab:
        bad = next(i for i in ids if not 0 <= i < vocab)
        raise ValueError(f"prompt holds token id {bad} outside the vocabulary [0, {vocab})")
    return arr.tolist()


def check_sampling(sp, vocab: int, tokenizer) -> None:
    """Raises ValueError when `sp` is not a SamplingParams or asks for what this model cannot do."""
    if not isinstance(sp, SamplingParams):
        raise ValueError("sampling must be a SamplingParams or a list of them, one per prompt")
    bad = [t for t in sp.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids holds id {bad[0]} outside the vocabulary [0, {vocab})")
    if sp.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")


def logprob_slots(params: list[SamplingParams]) -> int:
    """Top log-probabilities the loop keeps per token for these requests (0: none asked)."""
    asked = [sp.logprobs for sp in params if sp.logprobs is not None]
    return max(asked) + 1 if asked else 0


def default_sampling(model) -> SamplingParams:
    """Sampling when none is given: the checkpoint's generation_config.json, else greedy."""
    config = model.generation_config
    return SamplingParams.from_generation_config(config) if config else SamplingParams()


def stop_ids(model, tokenizer, sp: SamplingParams) -> list[int]:
    """Ids that end a row on the device: the request's stop ids, eos (unless ignored) and the
    tokens whose text holds one of its stop strings."""
    ids = list(sp.stop_token_ids)
    if not sp.ignore_eos:
        ids += list(model.config.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    if sp.stop and tokenizer is not None:
        ids += device_stop_ids(tokenizer, sp.stop)
    return sorted(set(ids))


@dataclass(frozen=True)
class Row:
    """One completion to generate: the prompt's position in its call (or its request id), the
    completion's index among the request's n, the prompt ids, the sampling and the row's seed."""

    index: int | str
    completion: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int


def expand_rows(index, prompt_ids: list[int], sp: SamplingParams) -> list[Row]:
    """The n rows of one request (completion c seeded with seed + c, or freshly)."""
    return [Row(index, c, tuple(prompt_ids), sp, sp.row_seed(c)) for c in range(sp.n)]


def with_agreed_seeds(rows: list[Row], placement) -> list[Row]:
    """`rows` with the seeds drawn fresh (SamplingParams.seed None) made the same on every process
    when the model spans several, which run one program in lockstep and so must sample alike: a
    greedy row's seed (unused) becomes 0, a sampled row's is the first process's (a collective among
    the mesh's processes, reached only when a fresh seed is sampled with)."""
    fresh = [r.sampling.seed is None for r in rows]
    if not placement.spans_processes or not any(fresh):
        return rows
    rows = [dataclasses.replace(r, seed=0) if f and r.sampling.temperature == 0 else r for r, f in zip(rows, fresh)]
    if not any(f and r.sampling.temperature > 0 for r, f in zip(rows, fresh)):
        return rows
    seeds = placement.from_first_process(np.array([r.seed for r in rows], np.uint32))
    return [dataclasses.replace(r, seed=int(s)) for r, s in zip(rows, seeds)]


def sampler_values(rows: list[Row | None], vocab: int) -> SamplerInputs:
    """Per-row sampling arrays (numpy) for `rows`; None marks a row to fill with neutral values."""
    def pick(f, default, dt):
        return np.array([f(r) if r is not None else default for r in rows], dt)
    return SamplerInputs(temperature=pick(lambda r: r.sampling.temperature, 0.0, np.float32),
                         top_k=pick(lambda r: min(r.sampling.top_k, vocab), 0, np.int32),
                         top_p=pick(lambda r: r.sampling.top_p, 1.0, np.float32),
                         seed=pick(lambda r: r.seed, 0, np.uint32),
                         repetition=pick(lambda r: r.sampling.repetition_penalty, 1.0, np.float32),
                         presence=pick(lambda r: r.sampling.presence_penalty, 0.0, np.float32),
                         frequency=pick(lambda r: r.sampling.frequency_penalty, 0.0, np.float32))


def stop_id_matrix(model, tokenizer, rows: list[Row | None], min_width: int = 1) -> np.ndarray:
    """[len(rows), S] int32 stop ids per row, -1 padded."""
    per_row = [stop_ids(model, tokenizer, r.sampling) if r is not None else [] for r in rows]
    out = np.full((len(rows), max(min_width, max((len(s) for s in per_row), default=0))), -1, np.int32)
    for i, s in enumerate(per_row):
        out[i, :len(s)] = s
    return out


def match_stop(tokenizer, row: Row, token_ids: list[int]) -> StopMatch | None:
    """The first stop string of the row's request in its generated tokens, or None."""
    sp = row.sampling
    if not sp.stop or tokenizer is None:
        return None
    return find_stop(tokenizer, token_ids, sp.stop, skip_special=sp.skip_special_tokens,
                     include_stop=sp.include_stop_str_in_output)


def completion_output(tokenizer, row: Row, token_ids: list[int], finish: int, match: StopMatch | None,
                      logprobs: list[tuple[float, list[int], list[float]]] | None) -> CompletionOutput:
    """The CompletionOutput of a finished row.

    finish: the loop's code (STOPPED / LENGTH / other = aborted). match: a stop string found between
    chunks (else the tokens are searched once more when the row stopped on the device).
    logprobs: per token (sampled logprob, top ids, top logprobs), when the request asked for them.
    """
    sp = row.sampling
    if match is None and int(finish) == STOPPED:
        match = match_stop(tokenizer, row, token_ids)
    reason = {STOPPED: "stop", LENGTH: "length"}.get(int(finish), "abort")
    if match is not None:
        token_ids, text, reason, stop_reason = token_ids[:match.tokens], match.text, "stop", match.stop
    else:
        text = decode_text(tokenizer, token_ids, sp.skip_special_tokens) if tokenizer is not None else None
        stop_reason = token_ids[-1] if reason == "stop" and token_ids else None
    lp, cumulative = None, None
    if sp.logprobs is not None and logprobs is not None:
        lp = []
        for tok, (chosen, top_ids, top_vals) in zip(token_ids, logprobs):
            entry = {int(i): float(v) for i, v in zip(top_ids[:sp.logprobs], top_vals[:sp.logprobs])}
            entry[int(tok)] = float(chosen)
            lp.append(entry)
        cumulative = float(sum(c for c, _, _ in logprobs[:len(token_ids)]))
    return CompletionOutput(row.completion, list(token_ids), text, reason, stop_reason, lp, cumulative)
