"""Host-side generation: prompts in (text, chat messages or token ids), text and token ids out.

    gen = k3jax.Generator(model, tokenizer)
    outs = gen.generate(["Hello", [{"role": "user", "content": "Hi"}]], SamplingParams(max_new_tokens=32))

Prompts are left-padded into a small set of length buckets (and the batch into power-of-two row
buckets), so repeated calls reuse compiled code. Prefill runs once, then the whole decode runs in
one compiled `lax.while_loop` (k3jax.decode_loop).
"""

from __future__ import annotations

import codecs
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import numpy as np

from k3jax.causal_lm import CausalLM
from k3jax.chat import encode_chat
from k3jax.decode_loop import LENGTH, STOPPED, decode_loop
from k3jax.sampling import SamplerInputs, SamplingParams

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
STEP_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class GenerationResult:
    """One prompt's outcome. finish_reason: "stop" (eos / stop id) or "length"."""

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


class Generator:
    """Generation for one model (and optionally its tokenizer), holding the compiled functions."""

    def __init__(self, model: CausalLM, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer
        self._active_stream = None
        self._loop = jax.jit(functools.partial(decode_loop, model.graphdef),
                             static_argnames=("max_steps", "filters", "stream_every", "stream", "pad_id"),
                             donate_argnames=("state",))

    # ----- prompts -----
    def encode_prompt(self, prompt, *, chat_options: dict | None = None) -> list[int]:
        """str -> text tokens; list of message dicts -> chat-rendered tokens; list of ints -> as given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (pass token ids, or a model directory with tiktoken.model)")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            if self.tokenizer is None:
                raise ValueError("chat prompts need a tokenizer")
            ids = encode_chat(prompt, self.tokenizer, family=self.model.config.model_type, **(chat_options or {}))
        else:
            ids = np.asarray(prompt).reshape(-1).tolist() if len(prompt) else []
            if not all(isinstance(i, (int, np.integer)) for i in ids):
                raise ValueError("a token-id prompt must be a list of integers")
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
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and (isinstance(prompts[0], dict) or isinstance(prompts[0], (int, np.integer)))):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        if stream is not None and (not isinstance(stream_every, int) or stream_every < 1):
            raise ValueError(f"stream_every must be a positive integer, got {stream_every!r}")
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
                                top_k=pick(lambda p: p.top_k, 0, np.int32),
                                top_p=pick(lambda p: p.top_p, 1.0, np.float32),
                                seed=pick(lambda p: p.seed, 0, np.uint32))
        max_new = pick(lambda p: p.max_new_tokens, 1, np.int32)
        prompt_len = np.array([len(e) for e in encoded] + [1] * (rows - n), np.int32)
        done = np.arange(rows) >= n

        t0 = time.perf_counter()
        logits, state = self.model.prefill(ids, mask, max_len=width + steps)
        logits.block_until_ready()
        t1 = time.perf_counter()
        self._active_stream = None if stream is None else _StreamAdapter(
            stream, n, self.tokenizer, [p.skip_special_tokens for p in params])
        put = self.model._put
        with self.model.mesh_context():
            out = self._loop(self.model.params, state, logits, jax.tree.map(put, sampler), put(stop_ids),
                             put(max_new), put(prompt_len), put(done), max_steps=steps,
                             filters=any(p.filters for p in params), stream_every=stream_every if stream else 0,
                             stream=self._on_stream if stream else None, pad_id=pad_id)
        tokens, count, finish = jax.device_get((out.tokens, out.count, out.finish))
        if self._active_stream is not None:
            jax.effects_barrier()  # every chunk delivered before the last flush
            self._active_stream.flush()
            self._active_stream = None
        t2 = time.perf_counter()

        results = []
        for i in range(n):
            toks = tokens[i, :count[i]].tolist()
            text = (self.tokenizer.decode(toks, skip_special=params[i].skip_special_tokens)
                    if self.tokenizer is not None else None)
            reason = {STOPPED: "stop", LENGTH: "length"}.get(int(finish[i]), "length")
            results.append(GenerationResult(encoded[i], toks, text, reason))
        timings = GenerationTimings(prefill_s=t1 - t0, decode_s=t2 - t1, new_tokens=int(count[:n].sum()),
                                    steps=int(count[:n].max()))
        return GenerationOutput(results, timings, {"rows": rows, "prompt": width, "steps": steps})

    def _on_stream(self, tokens, count):
        """The loop's host callback (one stable function, so streaming never recompiles)."""
        if self._active_stream is not None:
            self._active_stream(tokens, count)


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


def generate(model: CausalLM, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tokenizer=None, **kwargs) -> GenerationOutput:
    """One-call generation (keeps a Generator on the model so compiled code is reused)."""
    gen = getattr(model, "_generator", None)
    if gen is None or (tokenizer is not None and gen.tokenizer is not tokenizer):
        gen = Generator(model, tokenizer if tokenizer is not None else getattr(model, "tokenizer", None))
        model._generator = gen
    return gen.generate(prompts, sampling, **kwargs)
