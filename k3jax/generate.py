"""Host-side generation: prompts in (text, chat messages or token ids), text and token ids out.

    gen = k3jax.Generator(model)
    outs = gen.generate(["Hello", [{"role": "user", "content": "Hi"}]], SamplingParams(max_new_tokens=32))

Prompts are left-padded into a small set of length buckets (and the batch into power-of-two row
buckets), so repeated calls reuse compiled code. Prefill runs once, then decoding runs in the
compiled `lax.while_loop` (k3jax.decode_loop), handing control back to the host every few steps
to stream new tokens and to notice Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import signal
import threading
import time
import weakref
from typing import Callable, Sequence

import jax
import numpy as np

from k3jax.causal_lm import CausalLM
from k3jax.chat import encode_chat
from k3jax.decode_loop import LENGTH, STOPPED, LoopInputs, LoopState, decode_chunk, init_loop_state
from k3jax.outputs import CompletionOutput, GenerationOutput, GenerationResult, GenerationTimings, StreamChunk
from k3jax.sampling import SamplerInputs, SamplingParams
from k3jax.stop_strings import StopMatch, decode_text, device_stop_ids, find_stop
from k3jax.streaming import StreamAdapter

logger = logging.getLogger(__name__)

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
STEP_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CHUNK_STEPS = 32  # decode steps per return to the host when not streaming
STOP_STRING_CHUNK_STEPS = 8  # ... and when stop strings spanning tokens must be found on the host


def _bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what} of {n} exceeds the largest supported bucket {buckets[-1]}")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a generation between two decode chunks; `partial` holds what was generated."""

    def __init__(self, partial: GenerationOutput):
        super().__init__("generation interrupted")
        self.partial = partial


@contextlib.contextmanager
def _sigint_as_flag():
    """Within the block, the first Ctrl-C sets the returned event instead of raising (a second one
    raises at once); outside the main thread nothing changes."""
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event
        return

    def handler(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)


def _is_message_list(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


class Generator:
    """Generation for one model and its tokenizer. Immutable: it holds only the compiled decode
    chunk, so calls never share per-call state (streams, buffers) and may run from several threads."""

    def __init__(self, model: CausalLM, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        self.compiled_chunk = jax.jit(functools.partial(decode_chunk, model.graphdef),
                                      static_argnames=("filters", "pad_id"), donate_argnames=("carry",))

    # ----- prompts -----
    def encode_prompt(self, prompt, *, chat_options: dict | None = None) -> list[int]:
        """str -> text tokens; list of message dicts -> chat-rendered tokens; list of ints -> as given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (pass token ids, or a model directory with tiktoken.model)")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):
            raise ValueError("a chat prompt is a list of message dicts, got a single dict (wrap it in a list)")
        elif _is_message_list(prompt):
            if self.tokenizer is None:
                raise ValueError("chat prompts need a tokenizer")
            ids = encode_chat(prompt, self.tokenizer, family=self.model.config.model_type, **(chat_options or {}))
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = list(prompt.reshape(-1)) if isinstance(prompt, np.ndarray) and prompt.ndim == 1 else list(prompt)
            if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
                raise ValueError(f"a token-id prompt must be one-dimensional, got shape {prompt.shape}")
            if not all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) for i in ids):
                raise ValueError("a token-id prompt must be a flat list of integers")
        else:
            raise ValueError(f"a prompt must be a str, a list of message dicts or a list of token ids, "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt holds token id {bad[0]} outside the vocabulary [0, {vocab})")
        return [int(i) for i in ids]

    def _stop_ids(self, sp: SamplingParams) -> list[int]:
        ids = list(sp.stop_token_ids)
        if not sp.ignore_eos:
            ids += list(self.model.config.eos_token_id)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                ids.append(self.tokenizer.eos_token_id)
        if sp.stop and self.tokenizer is not None:
            ids += device_stop_ids(self.tokenizer, sp.stop)
        return sorted(set(ids))

    def default_sampling(self) -> SamplingParams:
        """Sampling when none is given: the checkpoint's generation_config.json, else greedy."""
        config = self.model.generation_config
        return SamplingParams.from_generation_config(config) if config else SamplingParams()

    # ----- generation -----
    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 stream: Callable[[StreamChunk], None] | None = None, stream_every: int = 8,
                 chat_options: dict | None = None) -> GenerationOutput:
        """Generates for a batch of prompts (one prompt may be passed bare).

        Args:
          prompts: a str, a chat message list, a token-id list, or a list of those.
          sampling: one SamplingParams for all prompts, or one per prompt (default:
            `default_sampling()`).
          stream: called with StreamChunk(s) of new tokens every `stream_every` decode steps.
          chat_options: renderer options (K3: thinking, thinking_effort, tools, ...).
        Returns:
          GenerationOutput: one GenerationResult per prompt, each with SamplingParams.n completions.
        Raises:
          GenerationInterrupted: on Ctrl-C, within one decode chunk, with the partial output.
        """
        if isinstance(prompts, (str, dict)) or _is_message_list(prompts) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("no prompts given")
        params = (list(sampling) if isinstance(sampling, (list, tuple))
                  else [sampling or self.default_sampling()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        if not all(isinstance(sp, SamplingParams) for sp in params):
            raise ValueError("sampling must be a SamplingParams or a list of them, one per prompt")
        if stream is not None and (not isinstance(stream_every, int) or isinstance(stream_every, bool)
                                   or stream_every < 1):
            raise ValueError(f"stream_every must be a positive integer, got {stream_every!r}")
        vocab = self.model.config.vocab_size
        for sp in params:
            bad = [t for t in sp.stop_token_ids if t >= vocab]
            if bad:
                raise ValueError(f"stop_token_ids holds id {bad[0]} outside the vocabulary [0, {vocab})")
            if sp.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer")
        encoded = [self.encode_prompt(p, chat_options=chat_options) for p in prompts]
        limit = self.model.config.max_position_embeddings
        for i, (ids, sp) in enumerate(zip(encoded, params)):
            if len(ids) + sp.max_tokens > limit:
                raise ValueError(f"prompt {i} of {len(ids)} tokens plus max_tokens {sp.max_tokens} exceeds "
                                 f"the context limit {limit}")
        # One batch row per completion.
        rows = [(i, c) for i, sp in enumerate(params) for c in range(sp.n)]
        row_params = [params[i] for i, _ in rows]
        row_prompts = [encoded[i] for i, _ in rows]
        seeds = [params[i].row_seed(c) for i, c in rows]
        n = len(rows)
        batch = _pow2(n)
        width = _bucket(max(len(e) for e in encoded), PROMPT_BUCKETS, "prompt length")
        steps = _bucket(max(sp.max_tokens for sp in params), STEP_BUCKETS, "max_tokens")
        pad_id = self.model.config.pad_token_id or 0
        ids = np.full((batch, width), pad_id, np.int32)
        mask = np.zeros((batch, width), np.int32)
        for r, e in enumerate(row_prompts):
            ids[r, width - len(e):] = e
            mask[r, width - len(e):] = 1
        mask[n:, -1] = 1  # padding rows: one token, never decoded
        stops = [self._stop_ids(sp) for sp in row_params]
        stop_ids = np.full((batch, max(1, max(len(s) for s in stops))), -1, np.int32)
        for r, s in enumerate(stops):
            stop_ids[r, :len(s)] = s
        pick = lambda f, default, dt: np.array([f(p) for p in row_params] + [default] * (batch - n), dt)
        sampler = SamplerInputs(temperature=pick(lambda p: p.temperature, 0.0, np.float32),
                                top_k=pick(lambda p: min(p.top_k, vocab), 0, np.int32),
                                top_p=pick(lambda p: p.top_p, 1.0, np.float32),
                                seed=np.array(seeds + [0] * (batch - n), np.uint32),
                                repetition=pick(lambda p: p.repetition_penalty, 1.0, np.float32),
                                presence=pick(lambda p: p.presence_penalty, 0.0, np.float32),
                                frequency=pick(lambda p: p.frequency_penalty, 0.0, np.float32))
        put = self.model.placement.put_rows
        inputs = LoopInputs(sampler=jax.tree.map(put, sampler), stop_ids=put(stop_ids),
                            max_new=put(pick(lambda p: p.max_tokens, 1, np.int32)),
                            prompt_len=put(np.array([len(e) for e in row_prompts] + [1] * (batch - n), np.int32)))
        seen = None
        if any(sp.penalized for sp in params):
            seen = np.zeros((batch, vocab), bool)
            for r, e in enumerate(row_prompts):
                seen[r, e] = True
            seen = put(seen)
        want_logprobs = [sp.logprobs for sp in row_params]
        logprobs_k = max([k for k in want_logprobs if k is not None], default=-1) + 1 if any(
            k is not None for k in want_logprobs) else 0
        # Every row needs at most `limit` slots (checked above); the bucketed width is left padding.
        max_len = min(width + steps, limit)
        row_stops = [sp.stop for sp in row_params]
        adapter = None if stream is None else StreamAdapter(stream, rows, self.tokenizer, row_stops,
                                                            [sp.skip_special_tokens for sp in row_params])
        chunk = stream_every if stream is not None else (
            STOP_STRING_CHUNK_STEPS if any(row_stops) else CHUNK_STEPS)
        filters = any(p.filters for p in params)
        logger.debug("generate: %d rows in a %d-row bucket, prompt width %d, %d steps", n, batch, width, steps)

        t0 = time.perf_counter()
        logits, state = self.model.prefill(ids, mask, max_len=max_len)
        logits.block_until_ready()
        t1 = time.perf_counter()
        matches: dict[int, StopMatch] = {}
        with self.model.placement.context(), _sigint_as_flag() as interrupted:
            carry = init_loop_state(state, logits, put(np.arange(batch) >= n), max_steps=steps, pad_id=pad_id,
                                    seen=seen, logprobs_k=max(logprobs_k, 0))
            done = False
            while not done and not interrupted.is_set():
                limit_step = min(steps, int(carry.step) + chunk)
                carry = self.compiled_chunk(self.model.params, carry, inputs, np.int32(limit_step), filters=filters,
                                            pad_id=pad_id)
                if any(row_stops) or adapter is not None:
                    carry = self._match_stops(carry, row_params, matches, adapter)
                all_done, step = jax.device_get((carry.done.all(), carry.step))
                done = bool(all_done) or int(step) >= steps
        tokens, count, finish, row_done = jax.device_get((carry.tokens, carry.count, carry.finish, carry.done))
        if adapter is not None:
            adapter.update(tokens, count, row_done, matches, final=True)
        t2 = time.perf_counter()
        logprob_arrays = None if carry.logprobs is None else jax.device_get(carry.logprobs)

        completions: list[list[CompletionOutput]] = [[] for _ in prompts]
        for r, (i, c) in enumerate(rows):
            completions[i].append(self._completion(r, c, row_params[r], tokens, count, finish, matches,
                                                   logprob_arrays))
        results = [GenerationResult(encoded[i], outs) for i, outs in enumerate(completions)]
        timings = GenerationTimings(prefill_s=t1 - t0, decode_s=t2 - t1, new_tokens=int(count[:n].sum()),
                                    steps=int(count[:n].max()))
        output = GenerationOutput(results, timings, {"rows": batch, "prompt": width, "steps": steps})
        if interrupted.is_set():
            raise GenerationInterrupted(output)
        return output

    def _match_stops(self, carry: LoopState, row_params: list[SamplingParams], matches: dict[int, StopMatch],
                     adapter: StreamAdapter | None) -> LoopState:
        """Between chunks: finds stop strings in the running rows (ending those rows on the device)
        and streams what is new."""
        tokens, count, done = jax.device_get((carry.tokens, carry.count, carry.done))
        ended = []
        for r, sp in enumerate(row_params):
            if sp.stop and r not in matches and count[r]:
                match = find_stop(self.tokenizer, tokens[r, :count[r]].tolist(), sp.stop,
                                  skip_special=sp.skip_special_tokens, include_stop=sp.include_stop_str_in_output)
                if match is not None:
                    matches[r] = match
                    if not done[r]:
                        ended.append(r)
        if adapter is not None:
            adapter.update(tokens, count, done, matches)
        if ended:
            rows = np.array(ended)
            carry = dataclasses.replace(carry, done=carry.done.at[rows].set(True),
                                        finish=carry.finish.at[rows].set(STOPPED))
        return carry

    def _completion(self, r: int, index: int, sp: SamplingParams, tokens, count, finish, matches, logprobs):
        """CompletionOutput of batch row r (stop strings cut, log-probabilities gathered)."""
        toks = tokens[r, :count[r]].tolist()
        match = matches.get(r)
        if match is None and sp.stop and int(finish[r]) == STOPPED and self.tokenizer is not None:
            match = find_stop(self.tokenizer, toks, sp.stop, skip_special=sp.skip_special_tokens,
                              include_stop=sp.include_stop_str_in_output)
        reason = {STOPPED: "stop", LENGTH: "length"}.get(int(finish[r]), "abort")
        if match is not None:
            toks, text, reason, stop_reason = toks[:match.tokens], match.text, "stop", match.stop
        else:
            text = (decode_text(self.tokenizer, toks, sp.skip_special_tokens) if self.tokenizer is not None
                    else None)
            stop_reason = toks[-1] if reason == "stop" and toks else None
        lp, cumulative = None, None
        if sp.logprobs is not None and logprobs is not None:
            lp = []
            for t, tok in enumerate(toks):
                entry = {int(i): float(v) for i, v in zip(logprobs.top_ids[r, t, :sp.logprobs],
                                                         logprobs.top_vals[r, t, :sp.logprobs])}
                entry[int(tok)] = float(logprobs.sampled[r, t])
                lp.append(entry)
            cumulative = float(np.sum(logprobs.sampled[r, :len(toks)]))
        return CompletionOutput(index, toks, text, reason, stop_reason, lp, cumulative)


_GENERATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate(model: CausalLM, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tokenizer=None, **kwargs) -> GenerationOutput:
    """One-call generation. The Generator of a model is kept (weakly) so compiled code is reused;
    keyword arguments as `Generator.generate`."""
    if tokenizer is not None and tokenizer is not model.tokenizer:
        return Generator(model, tokenizer).generate(prompts, sampling, **kwargs)
    gen = _GENERATORS.get(model)
    if gen is None:
        gen = _GENERATORS[model] = Generator(model)
    return gen.generate(prompts, sampling, **kwargs)
