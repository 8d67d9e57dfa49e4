"""The compiled decode loop: a `lax.while_loop` over decode steps with the state donated, run in
chunks of steps.

Stop conditions (eos / stop ids, per-row max_new_tokens) are checked on the device; nothing
returns to the host per token. The loop runs until `step_limit` (a traced scalar, so every chunk
reuses one compiled program) and hands its carry back to the host, which streams the new tokens,
matches stop strings, notices Ctrl-C, and runs the next chunk from the returned carry. Penalties
and log-probabilities keep their own state in the carry only when a request asks for them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.sampling import SamplerInputs, apply_penalties, sample, token_logprobs
from k3jax.state import DecodeState
from k3jax.steps import decode_step

RUNNING, STOPPED, LENGTH = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclass
class PenaltyState:
    """counts: [B, V] int32 occurrences of each token in the output so far. seen: [B, V] bool
    tokens of the prompt or the output (repetition penalty)."""

    counts: jax.Array
    seen: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class LogprobBuffers:
    """Per generated token: sampled [B, N] log-probability of the chosen token; top_ids / top_vals
    [B, N, K] the K most likely tokens and their log-probabilities (raw model distribution)."""

    sampled: jax.Array
    top_ids: jax.Array
    top_vals: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class LoopState:
    """The while_loop carry.

    state: model decode state. logits: [B, Vocab] fp32 for the next token (in decode_chunk's
    `sampled` order: those the latest token was sampled from). tokens: [B, N] int32
    generated so far. count: [B] tokens generated per row. done: [B]. finish: [B] RUNNING /
    STOPPED / LENGTH. step: scalar loop counter. penalty / logprobs: None unless requested. last:
    [B] int32 the tokens sampled by the latest step (pad for done rows).
    """

    state: DecodeState
    logits: jax.Array
    tokens: jax.Array
    count: jax.Array
    done: jax.Array
    finish: jax.Array
    step: jax.Array
    penalty: PenaltyState | None = None
    logprobs: LogprobBuffers | None = None
    last: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclass
class LoopInputs:
    """What stays fixed over a generation: sampling settings and stop conditions per row.

    sampler: per-row SamplerInputs. stop_ids: [B, S] int32 ids that end a row (-1 = unused).
    max_new: [B] int32 per-row limits. prompt_len: [B] int32 prompt lengths (sampling positions).
    """

    sampler: SamplerInputs
    stop_ids: jax.Array
    max_new: jax.Array
    prompt_len: jax.Array


def init_loop_state(state: DecodeState, logits, done, *, max_steps: int, pad_id: int, seen=None,
                    logprobs_k: int = 0) -> LoopState:
    """The carry after the prompt's prefill: logits [B, Vocab] for the first new token; done [B]
    marks rows that never decode (batch padding). seen: [B, Vocab] bool prompt tokens, when
    penalties are on. logprobs_k: top log-probabilities to keep per token (0: none kept).
    The fresh buffers come from one compiled call (op by op they cost milliseconds of host dispatch
    on a GPU, inside the time to first token); the decode state passes through untouched."""
    fresh = _fresh_loop_state(logits, done, seen, max_steps=max_steps, pad_id=pad_id, logprobs_k=logprobs_k)
    return dataclasses.replace(fresh, state=state)


@functools.partial(jax.jit, static_argnames=("max_steps", "pad_id", "logprobs_k"))
def _fresh_loop_state(logits, done, seen, *, max_steps: int, pad_id: int, logprobs_k: int) -> LoopState:
    """`init_loop_state` without the decode state (state=None)."""
    b, v = logits.shape
    penalty = None if seen is None else PenaltyState(counts=jnp.zeros((b, v), jnp.int32), seen=jnp.asarray(seen))
    buffers = None if not logprobs_k else LogprobBuffers(
        sampled=jnp.zeros((b, max_steps), jnp.float32), top_ids=jnp.zeros((b, max_steps, logprobs_k), jnp.int32),
        top_vals=jnp.zeros((b, max_steps, logprobs_k), jnp.float32))
    return LoopState(state=None, logits=logits.astype(jnp.float32),
                     tokens=jnp.full((b, max_steps), pad_id, jnp.int32), count=jnp.zeros((b,), jnp.int32),
                     done=jnp.asarray(done), finish=jnp.full((b,), RUNNING, jnp.int32), step=jnp.zeros((), jnp.int32),
                     penalty=penalty, logprobs=buffers, last=jnp.full((b,), pad_id, jnp.int32))


# "auto" runs AUTO_UNROLL steps per iteration on a GPU for batches of up to AUTO_UNROLL_MAX_ROWS rows.
AUTO_UNROLL = 4
AUTO_UNROLL_MAX_ROWS = 16


def loop_steps(choice: str, rows: int) -> int:
    """Decode steps per loop iteration for ModelConfig.loop_unroll. "auto": AUTO_UNROLL on a GPU for
    up to AUTO_UNROLL_MAX_ROWS rows, else 1. Each iteration ends in a read-back of the loop condition
    that leaves the GPU idle ~110 us on the H200 (48B shape, B=1, 64 forwards: 2.571 ms per token
    with 1 step per iteration, 2.486 with 4, 2.517 with 8); at larger batches the step is long enough
    that the read-back hardly counts, and one step per iteration compiles faster. Off the GPU 1
    (compile time in the tests)."""
    if choice != "auto":
        return int(choice)
    return AUTO_UNROLL if jax.default_backend() == "gpu" and rows <= AUTO_UNROLL_MAX_ROWS else 1


def sample_into(c: LoopState, logits, inputs: LoopInputs, *, filters: bool, pad_id: int) -> LoopState:
    """One token per running row sampled from `logits` [B, Vocab] fp32 and recorded at `c.step`
    (tokens, count, stop checks, penalties, log-probabilities); done rows get `pad_id`. Returns the
    carry with `logits`, the sampled tokens in `last`, and step + 1 (the model is not stepped)."""
    rows = jnp.arange(c.count.shape[0])
    with jax.named_scope("sampling"):
        scores = logits if c.penalty is None else apply_penalties(logits, inputs.sampler, c.penalty.counts,
                                                                  c.penalty.seen)
        tok = sample(scores, inputs.sampler, inputs.prompt_len + c.count, filters=filters)
        tok = jnp.where(c.done, pad_id, tok)
        logprobs = c.logprobs
        if logprobs is not None:
            chosen, top_ids, top_vals = token_logprobs(logits, tok, logprobs.top_ids.shape[2])
            logprobs = LogprobBuffers(logprobs.sampled.at[:, c.step].set(chosen, mode="drop"),
                                      logprobs.top_ids.at[:, c.step].set(top_ids, mode="drop"),
                                      logprobs.top_vals.at[:, c.step].set(top_vals, mode="drop"))
        penalty = c.penalty
        if penalty is not None:
            live = (~c.done).astype(jnp.int32)
            penalty = PenaltyState(penalty.counts.at[rows, tok].add(live),
                                   penalty.seen.at[rows, tok].set(penalty.seen[rows, tok] | ~c.done))
    tokens = c.tokens.at[:, c.step].set(tok, mode="drop")   # steps past the buffer write nothing
    count = c.count + (~c.done).astype(jnp.int32)
    stopped = ~c.done & jnp.any(tok[:, None] == inputs.stop_ids, axis=1)
    at_limit = ~c.done & ~stopped & (count >= inputs.max_new)
    finish = jnp.where(stopped, STOPPED, jnp.where(at_limit, LENGTH, c.finish))
    done = c.done | stopped | at_limit
    return dataclasses.replace(c, logits=logits, tokens=tokens, count=count, done=done, finish=finish,
                               step=c.step + 1, penalty=penalty, logprobs=logprobs, last=tok)


@functools.partial(jax.jit, static_argnames=("filters", "pad_id"), donate_argnames=("carry",))
def sample_first(carry: LoopState, inputs: LoopInputs, *, filters: bool,
                 pad_id: int = 0) -> tuple[LoopState, jax.Array]:
    """The first new token of every row, from the prefill's logits in the carry: (the carry that
    `decode_chunk(sampled=True)` continues from, its `last` token not yet fed to the model; its
    `host_view`)."""
    carry = sample_into(carry, carry.logits, inputs, filters=filters, pad_id=pad_id)
    return carry, host_view(carry)


def decode_chunk(graphdef, params, carry: LoopState, inputs: LoopInputs, step_limit, *, filters: bool,
                 pad_id: int = 0, unroll: int = 1, inner: str = "loop", sampled: bool = False) -> LoopState:
    """Samples tokens until every row is done or `carry.step` reaches `step_limit` (<= the token
    buffer's width); returns the carry to continue from.

    sampled (static): how a step is ordered. False: sample from `carry.logits`, then step the model
    on the sampled token (the carry always holds fresh logits; a row's last token is followed by a
    model step whose logits nobody reads). True: the carry holds a sampled token not yet fed
    (`carry.last`, from `sample_first`); a step feeds it to the model and samples from the logits,
    so the loop stops right after the last token is sampled and never steps the model past it.
    filters (static): apply top-k / top-p (off compiles them away).
    unroll (static): decode steps per loop iteration. The loop condition is read by the host once
    per iteration (the GPU idles meanwhile). With unroll > 1 whole iterations run while they fit
    below `step_limit`, then a second loop runs the remaining steps one per iteration, so a chunk
    never steps past its limit; a row that ends inside an iteration is followed by steps on padding
    until the iteration ends.
    inner (static): how an iteration runs its `unroll` steps: "loop", an inner loop of a known trip
    count (XLA runs it without reading anything back, so the host launches each step's command
    buffer while the GPU runs the one before), or "unrolled", copies of the step.
    """
    def cond(c: LoopState, steps: int = 1):
        return (c.step + steps <= step_limit) & ~jnp.all(c.done)

    def iteration(c: LoopState) -> LoopState:
        if inner == "loop" and unroll > 1:
            return jax.lax.fori_loop(0, unroll, lambda _, c: body(c), c)   # static bounds: a known trip count
        for _ in range(unroll):
            c = body(c)
        return c

    def body(c: LoopState) -> LoopState:
        # Always step the model (a conditional around it would copy the state on every step); the
        # loop condition ends the chunk once every row is done.
        if sampled:
            logits, state = decode_step(graphdef, params, c.state, c.last)
            return sample_into(dataclasses.replace(c, state=state), logits, inputs, filters=filters, pad_id=pad_id)
        c = sample_into(c, c.logits, inputs, filters=filters, pad_id=pad_id)
        next_logits, state = decode_step(graphdef, params, c.state, c.last)
        return dataclasses.replace(c, state=state, logits=next_logits)

    if unroll == 1:
        return jax.lax.while_loop(cond, body, carry)
    carry = jax.lax.while_loop(functools.partial(cond, steps=unroll), iteration, carry)
    return jax.lax.while_loop(cond, body, carry)      # the steps left, fewer than `unroll`


# Token buffers of up to this many entries travel with the status in a chunk's host view.
VIEW_TOKENS_MAX = 1 << 20


def host_view(c) -> jax.Array:
    """What the host reads after a chunk, as one int32 array (every read of a device array costs
    about 0.5 ms of host time on the GPU machine, whatever its size): [B, 4] count, finish, done,
    step per row, followed by the token buffer's N columns when B * N <= VIEW_TOKENS_MAX. `c`: a
    LoopState or a speculative loop's carry (same fields)."""
    b = c.count.shape[0]
    status = jnp.stack([c.count, c.finish, c.done.astype(jnp.int32), jnp.broadcast_to(c.step, (b,))],
                       axis=1).astype(jnp.int32)
    return jnp.concatenate([status, c.tokens], axis=1) if c.tokens.size <= VIEW_TOKENS_MAX else status


@dataclass
class HostCarry:
    """A host view read back: count, finish [B] int32, done [B] bool, step, and tokens [B, N] int32
    (None when the buffer was too large to travel with the status). Writable copies."""

    count: np.ndarray
    finish: np.ndarray
    done: np.ndarray
    step: int
    tokens: np.ndarray | None

    def tokens_of(self, carry, placement) -> np.ndarray:
        """The token buffer [B, N]: the view's copy, or read from `carry.tokens` (kept for later calls)."""
        if self.tokens is None:
            self.tokens = placement.to_host(carry.tokens)
        return self.tokens


def read_host_view(view, placement) -> HostCarry:
    """One transfer of `host_view`'s array -> HostCarry (gathered from every process whose devices
    hold rows of it: `Placement.to_host`)."""
    v = np.array(placement.to_host(view))
    return HostCarry(count=v[:, 0], finish=v[:, 1], done=v[:, 2].astype(bool), step=int(v[0, 3]),
                     tokens=v[:, 4:] if v.shape[1] > 4 else None)


def compiled_decode_chunk(graphdef, params):
    """(chunk, leaves): `decode_chunk` compiled over the parameters as a flat tuple of arrays, called
    as chunk(leaves, carry, inputs, step_limit, filters=, pad_id=, unroll=, inner=, sampled=) -> (carry, host_view)
    with the carry donated. A compiled call dispatches over a tuple of arrays in a fraction of the
    host time it takes over the nnx State (0.9 against 3.2 ms for the 48B shape's 603 arrays, paid
    once per chunk)."""
    leaves, treedef = jax.tree.flatten(params)

    def decode_chunk_flat(flat, carry, inputs, step_limit, **options):   # profiles find it as "decode_chunk"
        carry = decode_chunk(graphdef, jax.tree.unflatten(treedef, flat), carry, inputs, step_limit, **options)
        return carry, host_view(carry)

    return jax.jit(decode_chunk_flat, static_argnames=("filters", "pad_id", "unroll", "inner", "sampled"),
                   donate_argnames=("carry",)), tuple(leaves)
