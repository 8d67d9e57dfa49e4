"""Host-side generation: prompts in (text, chat messages or token ids), text and token ids out.

    gen = k3jax.Generator(model)
    outs = gen.generate(["Hello", [{"role": "user", "content": "Hi"}]], SamplingParams(max_new_tokens=32))

Prompts are left-padded into a small set of length buckets (and the batch into power-of-two row
buckets), so repeated calls reuse compiled code. Prefill runs once, then decoding runs in the
compiled `lax.while_loop` (k3jax.decode_loop), handing control back to the host every few steps
to stream new tokens and to notice Ctrl-C.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import numpy as np

from k3jax.causal_lm import CausalLM
from k3jax.chat import encode_chat
from k3jax.decode_loop import LENGTH, STOPPED, LoopInputs, decode_chunk, init_loop_state
from k3jax.sampling import SamplerInputs, SamplingParams

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
STEP_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CHUNK_STEPS = 32  # decode steps per return to the host when not streaming


@dataclass
class GenerationResult:
    """One prompt's outcome. finish_reason: "stop" (eos / stop id), "length", or "abort" (interrupted)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str


@dataclass
class GenerationTimings:
    prefill_s: float
    decode_s: float
    new_tokens: int
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class StreamChunk:
    """New tokens of one prompt since the previous chunk."""

    index: int
    token_ids: list[int]
    text: str | None


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
        return sorted(set(ids))

    # ----- generation -----
    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 stream: Callable[[StreamChunk], None] | None = None, stream_every: int = 8,
                 chat_options: dict | None = None) -> GenerationOutput:
        """Generates for a batch of prompts (one prompt may be passed bare).

        Args:
          prompts: a str, a chat message list, a token-id list, or a list of those.
          sampling: one SamplingParams for all prompts, or one per prompt.
          stream: called with StreamChunk(s) of new tokens every `stream_every` decode steps.
          chat_options: renderer options (K3: thinking, thinking_effort, tools, ...).
        Raises:
          GenerationInterrupted: on Ctrl-C, within one decode chunk, with the partial output.
        """
        if isinstance(prompts, (str, dict)) or _is_message_list(prompts) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("no prompts given")
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        if stream is not None and (not isinstance(stream_every, int) or isinstance(stream_every, bool)
                                   or stream_every < 1):
            raise ValueError(f"stream_every must be a positive integer, got {stream_every!r}")
        if not all(isinstance(sp, SamplingParams) for sp in params):
            raise ValueError("sampling must be a SamplingParams or a list of them, one per prompt")
        vocab = self.model.config.vocab_size
        for sp in params:
            bad = [t for t in sp.stop_token_ids if t >= vocab]
            if bad:
                raise ValueError(f"stop_token_ids holds id {bad[0]} outside the vocabulary [0, {vocab})")
        encoded = [self.encode_prompt(p, chat_options=chat_options) for p in prompts]
        limit = self.model.config.max_position_embeddings
        for i, (ids, sp) in enumerate(zip(encoded, params)):
            if len(ids) + sp.max_new_tokens > limit:
                raise ValueError(f"prompt {i} of {len(ids)} tokens plus max_new_tokens {sp.max_new_tokens} exceeds "
                                 f"the context limit {limit}")

        n = len(encoded)
        rows = _pow2(n)
        width = _bucket(max(len(e) for e in encoded), PROMPT_BUCKETS, "prompt length")
        steps = _bucket(max(sp.max_new_tokens for sp in params), STEP_BUCKETS, "max_new_tokens")
        pad_id = self.model.config.pad_token_id or 0
        ids = np.full((rows, width), pad_id, np.int32)
        mask = np.zeros((rows, width), np.int32)
        for i, e in enumerate(encoded):
            ids[i, width - len(e):] = e
            mask[i, width - len(e):] = 1
        mask[n:, -1] = 1  # padding rows: one token, never decoded
        stops = [self._stop_ids(sp) for sp in params]
        stop_ids = np.full((rows, max(1, max(len(s) for s in stops))), -1, np.int32)
        for i, s in enumerate(stops):
            stop_ids[i, :len(s)] = s
        pick = lambda f, default, dt: np.array([f(p) for p in params] + [default] * (rows - n), dt)
        sampler = SamplerInputs(temperature=pick(lambda p: p.temperature, 0.0, np.float32),
                                top_k=pick(lambda p: min(p.top_k, vocab), 0, np.int32),
                                top_p=pick(lambda p: p.top_p, 1.0, np.float32),
                                seed=pick(lambda p: p.seed, 0, np.uint32))
        put = self.model.placement.put_rows
        inputs = LoopInputs(sampler=jax.tree.map(put, sampler), stop_ids=put(stop_ids),
                            max_new=put(pick(lambda p: p.max_new_tokens, 1, np.int32)),
                            prompt_len=put(np.array([len(e) for e in encoded] + [1] * (rows - n), np.int32)))
        # Every row needs at most limit slots (checked above); the bucketed width is left padding.
        max_len = min(width + steps, limit)
        adapter = None if stream is None else _StreamAdapter(stream, n, self.tokenizer,
                                                             [p.skip_special_tokens for p in params])
        chunk = stream_every if stream is not None else CHUNK_STEPS
        filters = any(p.filters for p in params)

        t0 = time.perf_counter()
        logits, state = self.model.prefill(ids, mask, max_len=max_len)
        logits.block_until_ready()
        t1 = time.perf_counter()
        with self.model.placement.context(), _sigint_as_flag() as interrupted:
            carry = init_loop_state(state, logits, put(np.arange(rows) >= n), max_steps=steps, pad_id=pad_id)
            done = False
            while not done and not interrupted.is_set():
                limit_step = min(steps, int(carry.step) + chunk)
                carry = self.compiled_chunk(self.model.params, carry, inputs, np.int32(limit_step), filters=filters,
                                            pad_id=pad_id)
                all_done, step = jax.device_get((carry.done.all(), carry.step))
                if adapter is not None:
                    adapter(*jax.device_get((carry.tokens, carry.count)))
                done = bool(all_done) or int(step) >= steps
        tokens, count, finish = jax.device_get((carry.tokens, carry.count, carry.finish))
        if adapter is not None:
            adapter.flush()
        t2 = time.perf_counter()

        results = []
        for i in range(n):
            toks = tokens[i, :count[i]].tolist()
            text = (self.tokenizer.decode(toks, skip_special=params[i].skip_special_tokens)
                    if self.tokenizer is not None else None)
            reason = {STOPPED: "stop", LENGTH: "length"}.get(int(finish[i]), "abort")
            results.append(GenerationResult(encoded[i], toks, text, reason))
        timings = GenerationTimings(prefill_s=t1 - t0, decode_s=t2 - t1, new_tokens=int(count[:n].sum()),
                                    steps=int(count[:n].max()))
        output = GenerationOutput(results, timings, {"rows": rows, "prompt": width, "steps": steps})
        if interrupted.is_set():
            raise GenerationInterrupted(output)
        return output
class _StreamAdapter:
    """Turns the loop's token buffer into per-prompt chunks of new tokens (and UTF-8-safe text)."""

    def __init__(self, callback, n, tokenizer, skip_special):
        self.callback, self.n, self.tokenizer, self.skip_special = callback, n, tokenizer, skip_special
        self.sent = [0] * n
        self.decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(n)]

    def __call__(self, tokens, count):
        for i in range(self.n):
            new = tokens[i, self.sent[i]:count[i]].tolist()
            if not new:
                continue
            self.sent[i] = int(count[i])
            text = None
            if self.tokenizer is not None:
                shown = [t for t in new if t < self.tokenizer.num_base] if self.skip_special[i] else new
                text = self.decoders[i].decode(self.tokenizer.decode_bytes(shown))
            self.callback(StreamChunk(i, new, text))

    def flush(self):
        """Emits text held back for an incomplete UTF-8 sequence at the very end (no new tokens)."""
        if self.tokenizer is None:
            return
        for i in range(self.n):
            tail = self.decoders[i].decode(b"", final=True)
            if tail:
                self.callback(StreamChunk(i, [], tail))


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
