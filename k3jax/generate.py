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
from k3jax.decode_loop import (STOPPED, HostCarry, LoopInputs, LoopState, compiled_decode_chunk, host_view,
                               init_loop_state, loop_steps, read_host_view, sample_first)
from k3jax.memory_plan import check_generation_fits, device_capacity, mesh_spec_of, prefill_chunk_length
from k3jax.outputs import (CompletionOutput, GenerationOutput, GenerationResult, GenerationTimings, SpeculativeStats,
                           StreamChunk)
from k3jax.requests import (Row, check_sampling, completion_output, default_sampling, encode_prompt, expand_rows,
                            is_message_list, logprob_slots, match_stop, sampler_values, stop_id_matrix,
                            with_agreed_seeds)
from k3jax.sampling import SamplingParams
from k3jax.speculative import SpeculativeConfig
from k3jax.speculative.loop import init_spec_loop, spec_decode_chunk
from k3jax.speculative.sources import check_supported, prepare
from k3jax.stop_strings import StopMatch
from k3jax.streaming import StreamAdapter

logger = logging.getLogger(__name__)

# Up to the models' 1M-token context; what fits is decided by memory (`memory_plan.check_generation_fits`).
PROMPT_BUCKETS = tuple(1 << i for i in range(4, 21))
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


_host_view = jax.jit(host_view)

# The loop step after `sample_first`: the first token is step 0's.
FIRST_STEP = 1


class _Background:
    """fn() run on a new thread; `result()` waits for it and returns its value or raises its
    exception. For host work only (a read-back): JAX's per-thread settings do not reach the thread."""

    def __init__(self, fn: Callable):
        self._value, self._error = None, None

        def target():
            try:
                self._value = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                self._error = e

        self._thread = threading.Thread(target=target, name="k3jax-first-token", daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _read_timed(view, placement):
    """(the host view read back, the time it arrived)."""
    return read_host_view(view, placement), time.perf_counter()


def _spec_chunk_with_view(graphdef, params, **kwargs):
    """`spec_decode_chunk` -> (carry, host_view(carry))."""
    carry = spec_decode_chunk(graphdef, params, **kwargs)
    return carry, host_view(carry)


class Generator:
    """Generation for one model and its tokenizer. Immutable: it holds only the compiled decode
    chunk, so calls never share per-call state (streams, buffers) and may run from several threads,
    except for a model spanning several processes, whose calls every process makes in the same order
    from one thread (README, "Sharding and expert parallelism")."""

    def __init__(self, model: CausalLM, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        # (the model's parameters never change: CausalLM is immutable)
        self.compiled_chunk, self._param_leaves = compiled_decode_chunk(model.graphdef, model.params)
        self.compiled_spec_init = jax.jit(functools.partial(init_spec_loop, model.graphdef),
                                          static_argnames=("source", "max_tokens", "pad_id", "logprobs_k", "filters"),
                                          donate_argnames=("state",))
        self.compiled_spec_chunk = jax.jit(functools.partial(_spec_chunk_with_view, model.graphdef),
                                           static_argnames=("source", "filters"), donate_argnames=("carry",))

    # ----- prompts -----
    def encode_prompt(self, prompt, *, chat_options: dict | None = None) -> list[int]:
        """str -> text tokens; list of message dicts -> chat-rendered tokens; list of ints -> as given."""
        return encode_prompt(self.model, self.tokenizer, prompt, chat_options=chat_options)

    def default_sampling(self) -> SamplingParams:
        """Sampling when none is given: the checkpoint's generation_config.json, else greedy."""
        return default_sampling(self.model)

    # ----- generation -----
    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 stream: Callable[[StreamChunk], None] | None = None, stream_every: int = 8,
                 chat_options: dict | None = None, speculative: SpeculativeConfig | None = None) -> GenerationOutput:
        """Generates for a batch of prompts (one prompt may be passed bare).

        Args:
          prompts: a str, a chat message list, a token-id list, or a list of those.
          sampling: one SamplingParams for all prompts, or one per prompt (default:
            `default_sampling()`).
          stream: called with StreamChunk(s) of new tokens every `stream_every` decode steps.
          chat_options: renderer options (K3: thinking, thinking_effort, tools, ...).
          speculative: decode with drafts verified q = k + 1 tokens at a time (SpeculativeConfig);
            greedy output equals decoding without it token for token in exact arithmetic (tested
            in fp32; in bf16 a near-tie between the top logits can resolve the other way, since a
            q-token window sums in another order than q one-token steps), sampled output keeps
            the distribution. Statistics land in `timings.speculative`.
        Returns:
          GenerationOutput: one GenerationResult per prompt, each with SamplingParams.n completions.
        Raises:
          GenerationInterrupted: on Ctrl-C, within one decode chunk, with the partial output.
        """
        if isinstance(prompts, (str, dict)) or is_message_list(prompts) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("no prompts given")
        params = (list(sampling) if isinstance(sampling, (list, tuple))
                  else [sampling or self.default_sampling()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        if stream is not None and (not isinstance(stream_every, int) or isinstance(stream_every, bool)
                                   or stream_every < 1):
            raise ValueError(f"stream_every must be a positive integer, got {stream_every!r}")
        vocab = self.model.config.vocab_size
        for sp in params:
            check_sampling(sp, vocab, self.tokenizer)
        if speculative is not None:
            if not isinstance(speculative, SpeculativeConfig):
                raise ValueError("speculative must be a SpeculativeConfig")
            check_supported(speculative, self.model.config)
            if any(sp.penalized for sp in params):
                raise ValueError("repetition, presence and frequency penalties are not supported with "
                                 "speculative decoding")
        encoded = [self.encode_prompt(p, chat_options=chat_options) for p in prompts]
        limit = self.model.config.max_position_embeddings
        for i, (ids, sp) in enumerate(zip(encoded, params)):
            if len(ids) + sp.max_tokens > limit:
                raise ValueError(f"prompt {i} of {len(ids)} tokens plus max_tokens {sp.max_tokens} exceeds "
                                 f"the context limit {limit}")
        rows = [row for i, (ids, sp) in enumerate(zip(encoded, params)) for row in expand_rows(i, ids, sp)]
        rows = with_agreed_seeds(rows, self.model.placement)
        n = len(rows)
        batch = _pow2(n)
        width = _bucket(max(len(e) for e in encoded), PROMPT_BUCKETS, "prompt length")
        longest = max(sp.max_tokens for sp in params)     # the loop's last step (no row runs past it)
        steps = _bucket(longest, STEP_BUCKETS, "max_tokens")   # the token buffer's width
        pad_id = self.model.config.pad_token_id or 0
        ids = np.full((batch, width), pad_id, np.int32)
        mask = np.zeros((batch, width), np.int32)
        for r, row in enumerate(rows):
            ids[r, width - len(row.prompt_ids):] = row.prompt_ids
            mask[r, width - len(row.prompt_ids):] = 1
        mask[n:, -1] = 1  # padding rows: one token, never decoded
        padded = rows + [None] * (batch - n)
        put = self.model.placement.put_rows
        inputs = LoopInputs(sampler=jax.tree.map(put, sampler_values(padded, vocab)),
                            stop_ids=put(stop_id_matrix(self.model, self.tokenizer, padded)),
                            max_new=put(np.array([r.sampling.max_tokens if r else 1 for r in padded], np.int32)),
                            prompt_len=put(np.array([len(r.prompt_ids) if r else 1 for r in padded], np.int32)))
        seen = None
        if any(sp.penalized for sp in params):
            seen = np.zeros((batch, vocab), bool)
            for r, row in enumerate(rows):
                seen[r, list(row.prompt_ids)] = True
            seen = put(seen)
        logprobs_k = logprob_slots(params)
        # Every row needs at most `limit` slots (checked above); the bucketed width is left padding.
        max_len = min(width + steps, limit)
        model = self.model
        device = jax.devices()[0] if model.mesh is None else model.mesh.local_devices[0]
        # Prompts are prefilled in chunks (CausalLM.prefill_into), except for drafters that read the
        # hidden state of every prompt position (MTP): one call.
        one_call = speculative is not None and speculative.method == "mtp"
        per_call = width if one_call else prefill_chunk_length(batch, width, model.config.prefill_chunk_tokens)
        check_generation_fits(model.config, mesh_spec_of(model.mesh), model.dtype, batch=batch, capacity_tokens=max_len,
                              prompt_tokens=per_call, capacity=device_capacity(device))
        row_stops = [row.sampling.stop for row in rows]
        adapter = None if stream is None else StreamAdapter(stream, [(r.index, r.completion) for r in rows],
                                                            self.tokenizer, row_stops,
                                                            [r.sampling.skip_special_tokens for r in rows])
        chunk = stream_every if stream is not None else (
            STOP_STRING_CHUNK_STEPS if any(row_stops) else CHUNK_STEPS)
        filters = any(p.filters for p in params)
        logger.debug("generate: %d rows in a %d-row bucket, prompt width %d, %d steps", n, batch, width, steps)

        run = dict(ids=ids, mask=mask, max_len=max_len, inputs=inputs, batch=batch, n=n, steps=steps,
                   pad_id=pad_id, seen=seen, logprobs_k=logprobs_k, filters=filters)
        options = dict(filters=filters, pad_id=pad_id, unroll=loop_steps(self.model.config.loop_unroll, batch),
                       inner=self.model.config.loop_inner, sampled=True)

        def plain_chunk(carry: LoopState, limit_step: int):
            return self.compiled_chunk(self._param_leaves, carry, inputs, np.int32(limit_step), **options)

        # Without stop strings or a stream the host has nothing to do with the first token before the
        # loop runs, so the first chunk (up to step 1's chunk limit) can start while it is read back.
        # Not when the model spans processes: reading rows back may then be a collective, kept on this thread.
        overlap = (speculative is None and self.model.config.loop_start == "overlap" and adapter is None
                   and not any(row_stops) and longest > FIRST_STEP and not self.model.placement.spans_processes)
        t0 = time.perf_counter()
        source = first_read = None
        if speculative is None:
            carry, view = self._prefill_plain(**run)
            if overlap:     # a helper thread reads the first token (and times it) while the chunk starts here
                view.copy_to_host_async()
                # The view is bound now: `view` is rebound to the first chunk's below, maybe before the thread runs.
                first_read = _Background(functools.partial(_read_timed, view, self.model.placement))
            else:   # the time to first token ends with the first token on the host
                host = read_host_view(view, self.model.placement)
        else:
            carry, source = self._prefill_speculative(speculative, width=width, **run)
            host = read_host_view(_host_view(carry), self.model.placement)
        t1 = time.perf_counter()        # every row's first token is on the host (with overlap: see below)
        matches: dict[int, StopMatch] = {}
        with self.model.placement.context(), _sigint_as_flag() as interrupted:
            if first_read is not None:
                # The first chunk, called before the first token is on the host: this call returns when
                # the chunk's loop ends, the helper's read long before (when every row ended with its
                # first token, the chunk runs no step).
                carry, view = plain_chunk(carry, min(longest, (FIRST_STEP // chunk + 1) * chunk))
                first, t1 = first_read.result()
                if first.step != FIRST_STEP:
                    raise RuntimeError(f"the first token's step is {first.step}, expected {FIRST_STEP}")
                host = read_host_view(view, self.model.placement)
            step = host.step
            done = bool(host.done.all()) or step >= longest
            if done and (any(row_stops) or adapter is not None):    # e.g. max_tokens=1: no chunk runs
                carry = self._match_stops(carry, host, rows, matches, adapter)
            while not done and not interrupted.is_set():
                limit_step = min(longest, (step // chunk + 1) * chunk)   # chunk ends at multiples of `chunk`
                if speculative is None:
                    carry, view = plain_chunk(carry, limit_step)
                else:
                    carry, view = self.compiled_spec_chunk(self.model.params, carry=carry, inputs=inputs,
                                                           step_limit=np.int32(limit_step), source=source,
                                                           filters=filters)
                host = read_host_view(view, self.model.placement)       # one transfer per chunk
                if any(row_stops) or adapter is not None:
                    carry = self._match_stops(carry, host, rows, matches, adapter)
                step = host.step
                done = bool(host.done.all()) or step >= longest
        tokens = host.tokens_of(carry, self.model.placement)
        count, finish, row_done = host.count, host.finish, host.done
        if adapter is not None:
            adapter.update(tokens, count, row_done, matches, final=True)
        t2 = time.perf_counter()
        logprob_arrays = None if carry.logprobs is None else self.model.placement.to_host(carry.logprobs)

        completions: list[list[CompletionOutput]] = [[] for _ in prompts]
        for r, row in enumerate(rows):
            toks = tokens[r, :count[r]].tolist()
            lp = None if logprob_arrays is None else [
                (logprob_arrays.sampled[r, t], logprob_arrays.top_ids[r, t], logprob_arrays.top_vals[r, t])
                for t in range(len(toks))]
            completions[row.index].append(completion_output(self.tokenizer, row, toks, finish[r], matches.get(r), lp))
        results = [GenerationResult(encoded[i], outs) for i, outs in enumerate(completions)]
        timings = GenerationTimings(prefill_s=t1 - t0, decode_s=t2 - t1, new_tokens=int(count[:n].sum()),
                                    steps=int(count[:n].max()), first_tokens=int((count[:n] > 0).sum()),
                                    speculative=None if speculative is None else self._spec_stats(speculative, carry, n))
        output = GenerationOutput(results, timings, {"rows": batch, "prompt": width, "steps": steps})
        if interrupted.is_set():
            raise GenerationInterrupted(output)
        return output

    def _prefill_plain(self, *, ids, mask, max_len, inputs, batch, n, steps, pad_id, seen, logprobs_k, filters):
        """Prefill and the first token, dispatched: (the carry to decode from, its host view on the device)."""
        logits, state = self.model.prefill(ids, mask, max_len=max_len)
        with self.model.placement.context():
            carry = init_loop_state(state, logits, self.model.placement.put_rows(np.arange(batch) >= n),
                                    max_steps=steps, pad_id=pad_id, seen=seen, logprobs_k=logprobs_k)
            # The first token is part of the prefill; the loop then never steps the model past a row's last token.
            return sample_first(carry, inputs, filters=filters, pad_id=pad_id)

    def _prefill_speculative(self, spec: SpeculativeConfig, *, ids, mask, max_len, inputs, batch, n, steps, width,
                             pad_id, seen, logprobs_k, filters):
        """Prefill, the first token and the first drafts: (carry, draft source). The cache gets two
        windows of scratch slots past max_len: a verify window and the draft chain after it."""
        model = self.model
        scratch = 2 * spec.window
        source, extra = prepare(spec, model.config, batch=batch, rows=n, prompt_width=width, max_tokens=steps,
                                capacity=max_len + scratch, dtype=model.dtype)
        put = model.placement.put_rows
        state = model.init_state(batch, max_len, scratch=scratch)
        with model.placement.context():
            if source.needs_hidden:  # the drafter reads every prompt position's hidden state: one call
                logits, hidden, state = model.steps.prefill_hidden(model.params, put(ids), put(mask), state)
            else:
                logits, state = model.prefill_into(ids, mask.astype(bool), state, fresh=True, donate=True)
                hidden = None
            carry = self.compiled_spec_init(model.params, source=source, logits_BV=logits, hidden_BTD=hidden,
                                            state=state, ids_BT=put(ids), valid_BT=put(mask.astype(bool)),
                                            extra=jax.tree.map(lambda x: put(x) if np.ndim(x) else x, extra),
                                            inputs=inputs, done_B=put(np.arange(batch) >= n), max_tokens=steps,
                                            pad_id=pad_id, logprobs_k=logprobs_k, filters=filters)
        carry.count.block_until_ready()
        return carry, source

    def _spec_stats(self, spec: SpeculativeConfig, carry, n: int) -> SpeculativeStats:
        steps, accepted_at = self.model.placement.to_host((carry.stats.steps, carry.stats.accepted_at))
        total = int(steps[:n].sum())
        per_position = accepted_at[:n].sum(axis=0)
        return SpeculativeStats(method=spec.method, num_draft_tokens=spec.num_draft_tokens, steps=total,
                                accepted=int(per_position.sum()),
                                acceptance_rate=[float(x) / total if total else float("nan") for x in per_position])

    def _match_stops(self, carry: LoopState, host: HostCarry, rows: list[Row], matches: dict[int, StopMatch],
                     adapter: StreamAdapter | None) -> LoopState:
        """Between chunks: finds stop strings in the running rows (ending those rows on the device and
        in `host`) and streams what is new."""
        tokens, count, done = host.tokens_of(carry, self.model.placement), host.count, host.done
        ended = []
        for r, row in enumerate(rows):
            if row.sampling.stop and r not in matches and count[r]:
                match = match_stop(self.tokenizer, row, tokens[r, :count[r]].tolist())
                if match is not None:
                    matches[r] = match
                    if not done[r]:
                        ended.append(r)
        if adapter is not None:
            adapter.update(tokens, count, done.copy(), matches)
        if ended:
            ended_rows = np.array(ended)
            carry = dataclasses.replace(carry, done=carry.done.at[ended_rows].set(True),
                                        finish=carry.finish.at[ended_rows].set(STOPPED))
            host.done[ended_rows] = True
            host.finish[ended_rows] = STOPPED
        return carry


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
