"""Continuous batching: a fixed number of slots decoding together, new requests admitted into
free slots between decode chunks, finished ones retired, nothing recompiled.

    engine = Engine(model, EngineConfig(max_slots=64, max_len=4096))
    engine.add("a", "Hello", SamplingParams(max_tokens=32))
    while engine.has_work():
        for update in engine.step():
            ...   # update.new_tokens per completion; update.result once the request is done

Each `step` admits waiting completions into free slots (their prompts prefilled together and
written into those slots of the batched decode state), runs one compiled decode chunk over all
slots (k3jax.decode_loop: the same loop, the same sampling positions and seeds as
`k3jax.generate`, so a request's tokens do not depend on what it is batched with), then collects
new tokens, matches stop strings and retires finished completions. A request's n completions are
n slots. This is the core the batch jobs (serve.batch) and the HTTP server share.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.causal_lm import CausalLM
from k3jax.decode_loop import (RUNNING, LoopInputs, LoopState, compiled_decode_chunk, init_loop_state, loop_steps,
                               read_host_view)
from k3jax.errors import ConfigError, require_positive
from k3jax.generate import PROMPT_BUCKETS
from k3jax.outputs import CompletionOutput, GenerationResult
from k3jax.requests import (Row, check_sampling, completion_output, default_sampling, encode_prompt, expand_rows,
                            match_stop, sampler_values, stop_id_matrix, with_agreed_seeds)
from k3jax.sampling import MAX_LOGPROBS, SamplingParams
from k3jax.stop_strings import StopMatch


@dataclass(frozen=True)
class EngineConfig:
    """max_slots: rows decoding together. max_len: tokens per row (prompt + output).
    chunk_steps: decode steps between two visits of the host (admission, retirement, streaming).
    max_logprobs: the most top log-probabilities a request may ask for (None: requests may not ask).
    penalties: keep the state repetition / presence / frequency penalties need (off: refused).
    max_stop_ids: stop ids per row checked on the device."""

    max_slots: int = 64
    max_len: int = 4096
    chunk_steps: int = 16
    max_logprobs: int | None = None
    penalties: bool = False
    max_stop_ids: int = 256

    def __post_init__(self):
        for name in ("max_slots", "max_len", "chunk_steps", "max_stop_ids"):
            require_positive(getattr(self, name), f"engine.{name}")
        if self.max_logprobs is not None and not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"invalid config field 'engine.max_logprobs': expected None or 0..{MAX_LOGPROBS}")


@dataclass
class EngineUpdate:
    """Progress of one request in a step: new tokens per completion index, and the whole result
    once every completion has finished."""

    request_id: str
    new_tokens: dict[int, list[int]] = field(default_factory=dict)
    result: GenerationResult | None = None


@dataclass
class _Slot:
    row: Row
    generated: list[int] = field(default_factory=list)
    logprobs: list[tuple] = field(default_factory=list)
    match: StopMatch | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    completions: dict[int, CompletionOutput] = field(default_factory=dict)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _insert(carry: LoopState, inputs: LoopInputs, state, logits, slots, sampler, stop_ids, seen) -> tuple:
    """Writes freshly prefilled rows into `slots` of the batched carry and inputs (rows whose slot
    index is out of range are dropped)."""
    put = lambda big, small: big.at[slots].set(small.astype(big.dtype), mode="drop")
    new_state = jax.tree.map(put, carry.state, state)
    penalty = carry.penalty
    if penalty is not None:
        penalty = dataclasses.replace(penalty, counts=put(penalty.counts, jnp.zeros_like(seen, jnp.int32)),
                                      seen=put(penalty.seen, seen))
    carry = dataclasses.replace(carry, state=new_state, logits=put(carry.logits, logits), penalty=penalty)
    inputs = dataclasses.replace(inputs, sampler=jax.tree.map(put, inputs.sampler, sampler),
                                 stop_ids=put(inputs.stop_ids, stop_ids))
    return carry, inputs


class Engine:
    """Continuous batching over one model (see the module docstring)."""

    def __init__(self, model: CausalLM, config: EngineConfig = EngineConfig(), *, tokenizer=None):
        if config.max_len > model.config.max_position_embeddings:
            raise ConfigError(f"invalid config field 'engine.max_len': {config.max_len} exceeds the model's context "
                              f"limit {model.config.max_position_embeddings}")
        self.model, self.config = model, config
        self.tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        self.pad_id = model.config.pad_token_id or 0
        s, vocab = config.max_slots, model.config.vocab_size
        self._slots: list[_Slot | None] = [None] * s
        self._waiting: collections.deque[Row] = collections.deque()
        self._requests: dict[str, _Request] = {}
        put = model.placement.put_rows
        with model.placement.context():
            state = model.init_state(s, config.max_len)
            seen = put(np.zeros((s, vocab), bool)) if config.penalties else None
            k = 0 if config.max_logprobs is None else config.max_logprobs + 1
            self._carry = init_loop_state(state, jnp.zeros((s, vocab), jnp.float32), put(np.ones(s, bool)),
                                          max_steps=config.chunk_steps, pad_id=self.pad_id, seen=seen, logprobs_k=k)
        self._inputs = LoopInputs(sampler=jax.tree.map(put, sampler_values([None] * s, vocab)),
                                  stop_ids=put(np.full((s, config.max_stop_ids), -1, np.int32)),
                                  max_new=put(np.ones(s, np.int32)), prompt_len=put(np.ones(s, np.int32)))
        self._unroll = loop_steps(model.config.loop_unroll, config.max_slots)   # a chunk never steps past its end
        self._chunk, self._param_leaves = compiled_decode_chunk(model.graphdef, model.params)
        self._insert = jax.jit(_insert, donate_argnums=(0, 1))

    # ----- requests -----
    def add(self, request_id: str, prompt, sampling: SamplingParams | None = None, *,
            chat_options: dict | None = None) -> None:
        """Queues a request (prompt: text, chat messages or token ids). Raises ValueError for a bad
        or duplicate request, one the engine cannot hold, or options it was not built for."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        sp = sampling if sampling is not None else default_sampling(self.model)
        check_sampling(sp, self.model.config.vocab_size, self.tokenizer)
        if sp.penalized and not self.config.penalties:
            raise ValueError("penalties need an engine built with EngineConfig(penalties=True)")
        if sp.logprobs is not None and (self.config.max_logprobs is None or sp.logprobs > self.config.max_logprobs):
            raise ValueError(f"logprobs={sp.logprobs} exceeds what the engine keeps "
                             f"(EngineConfig.max_logprobs={self.config.max_logprobs})")
        ids = encode_prompt(self.model, self.tokenizer, prompt, chat_options=chat_options)
        if len(ids) + sp.max_tokens > self.config.max_len:
            raise ValueError(f"prompt of {len(ids)} tokens plus max_tokens {sp.max_tokens} exceeds the engine's "
                             f"max_len {self.config.max_len}")
        if sp.n > self.config.max_slots:
            raise ValueError(f"n={sp.n} exceeds the engine's {self.config.max_slots} slots")
        rows = with_agreed_seeds(expand_rows(request_id, ids, sp), self.model.placement)
        self._requests[request_id] = _Request(ids, sp)
        self._waiting.extend(rows)

    def abort(self, request_id: str) -> GenerationResult | None:
        """Drops a request (waiting or running); returns what it had generated, or None if unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self._waiting = collections.deque(r for r in self._waiting if r.index != request_id)
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.row.index == request_id:
                request.completions[slot.row.completion] = completion_output(
                    self.tokenizer, slot.row, slot.generated, -1, slot.match, slot.logprobs or None)
                self._slots[i] = None
        outputs = [request.completions[c] for c in sorted(request.completions)]
        return GenerationResult(request.prompt_ids, outputs) if outputs else None

    def has_work(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    @property
    def num_running(self) -> int:
        return len({s.row.index for s in self._slots if s is not None})

    @property
    def num_waiting(self) -> int:
        return len({r.index for r in self._waiting} - {s.row.index for s in self._slots if s is not None})

    # ----- one step -----
    def step(self) -> list[EngineUpdate]:
        """Admits waiting completions into free slots, runs one decode chunk, retires what finished."""
        with self.model.placement.context():
            self._admit()
            if not any(s is not None for s in self._slots):
                return []
            return self._decode()

    def _admit(self) -> None:
        free = [i for i, s in enumerate(self._slots) if s is None]
        take = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        if not take:
            return
        k = _pow2(len(take))
        longest, max_len = max(len(r.prompt_ids) for r in take), self.config.max_len
        width = min(next((b for b in PROMPT_BUCKETS if b >= longest), max_len), max_len)  # add() kept longest <= max_len
        ids = np.full((k, width), self.pad_id, np.int32)
        mask = np.zeros((k, width), np.int32)
        for j, row in enumerate(take):
            ids[j, width - len(row.prompt_ids):] = row.prompt_ids
            mask[j, width - len(row.prompt_ids):] = 1
        mask[len(take):, -1] = 1
        logits, state = self.model.prefill(ids, mask, max_len=self.config.max_len)
        padded = take + [None] * (k - len(take))
        slots = np.array(free[:len(take)] + [self.config.max_slots] * (k - len(take)), np.int32)
        vocab = self.model.config.vocab_size
        seen = np.zeros((k, vocab), bool)
        for j, row in enumerate(take):
            seen[j, list(row.prompt_ids)] = True
        stops = stop_id_matrix(self.model, self.tokenizer, padded, self.config.max_stop_ids)[:, :self.config.max_stop_ids]
        put = self.model.placement.put_rows
        self._carry, self._inputs = self._insert(self._carry, self._inputs, state, logits, put(slots),
                                                 jax.tree.map(put, sampler_values(padded, vocab)), put(stops),
                                                 put(seen))
        for j, row in enumerate(take):
            self._slots[free[j]] = _Slot(row)

    def _decode(self) -> list[EngineUpdate]:
        s, steps = self.config.max_slots, self.config.chunk_steps
        active = np.array([slot is not None for slot in self._slots])
        remaining = np.array([slot.row.sampling.max_tokens - len(slot.generated) if slot else 1
                              for slot in self._slots], np.int32)
        position = np.array([len(slot.row.prompt_ids) + len(slot.generated) if slot else 1 for slot in self._slots],
                            np.int32)
        put = self.model.placement.put_rows
        inputs = dataclasses.replace(self._inputs, max_new=put(remaining), prompt_len=put(position))
        carry = dataclasses.replace(self._carry, tokens=jnp.full((s, steps), self.pad_id, jnp.int32),
                                    count=jnp.zeros((s,), jnp.int32), done=put(~active),
                                    finish=jnp.full((s,), RUNNING, jnp.int32), step=jnp.zeros((), jnp.int32))
        filters = any(slot.row.sampling.filters for slot in self._slots if slot is not None)
        self._carry, view = self._chunk(self._param_leaves, carry, inputs, np.int32(steps), filters=filters,
                                        pad_id=self.pad_id, unroll=self._unroll, inner=self.model.config.loop_inner)
        host = read_host_view(view, self.model.placement)     # one transfer
        tokens = host.tokens_of(self._carry, self.model.placement)
        count, finish = host.count, host.finish
        lp = None if self._carry.logprobs is None else self.model.placement.to_host(self._carry.logprobs)
        return self._collect(tokens, count, finish, lp)

    def _collect(self, tokens, count, finish, lp) -> list[EngineUpdate]:
        updates: dict[str, EngineUpdate] = {}
        for i, slot in enumerate(self._slots):
            if slot is None:
                continue
            row = slot.row
            new = tokens[i, :count[i]].tolist()
            slot.generated += new
            if lp is not None and row.sampling.logprobs is not None:
                slot.logprobs += [(lp.sampled[i, t], lp.top_ids[i, t], lp.top_vals[i, t]) for t in range(len(new))]
            if slot.match is None:
                slot.match = match_stop(self.tokenizer, row, slot.generated)
            update = updates.setdefault(row.index, EngineUpdate(row.index))
            kept = slot.generated if slot.match is None else slot.generated[:slot.match.tokens]
            before = len(slot.generated) - len(new)             # tokens reported in earlier steps
            update.new_tokens[row.completion] = kept[before:]    # empty once a stop string cut them
            if int(finish[i]) != RUNNING or slot.match is not None:
                request = self._requests[row.index]
                request.completions[row.completion] = completion_output(
                    self.tokenizer, row, slot.generated, finish[i], slot.match, slot.logprobs or None)
                self._slots[i] = None
                if len(request.completions) == request.sampling.n:
                    del self._requests[row.index]
                    update.result = GenerationResult(request.prompt_ids,
                                                     [request.completions[c] for c in range(request.sampling.n)])
        return list(updates.values())
