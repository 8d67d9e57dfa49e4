"""The compiled speculative decode loop: each step verifies the pending token plus k drafts in one
forward (q = k + 1 tokens per row), decides acceptance on the device, appends 1..q tokens per row,
commits exactly the accepted tokens to the state, and asks the draft source for the next drafts.
Nothing returns to the host per step; like `k3jax.decode_loop` it runs in chunks of steps.

Per step and row: window = [pending, d_1 .. d_k]; target[j] is the token the target emits after
window token j; a = leading accepted drafts; the output gains target[0 .. a] (cut at a stop token
or the row's limit); the state keeps window[0 .. a]; target[a] becomes the next pending token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from k3jax.decode_loop import LENGTH, RUNNING, STOPPED, LogprobBuffers, LoopInputs
from k3jax.sampling import sample, token_logprobs
from k3jax.speculative.acceptance import verify_tokens
from k3jax.speculative.context import PromptView, VerifyOutcome
from k3jax.state import DecodeState
from k3jax.steps import commit_step, verify_step


@jax.tree_util.register_dataclass
@dataclass
class SpecStats:
    """steps: [B] verify steps each row took part in. accepted_at: [B, K] how often the draft at
    window position i was accepted and reached the output (a stop token or the length limit inside
    an accepted run cuts it)."""

    steps: jax.Array
    accepted_at: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class SpecLoopState:
    """The while_loop carry. state: target decode state (every generated token but `pending`).
    pending: [B] the last generated token, not yet fed. drafts: [B, K] proposals for the tokens
    after it. source: the draft source's own state. tokens [B, N] / count / done / finish / step /
    logprobs as in `k3jax.decode_loop.LoopState`."""

    state: DecodeState
    pending: jax.Array
    drafts: jax.Array
    source: Any
    tokens: jax.Array
    count: jax.Array
    done: jax.Array
    finish: jax.Array
    step: jax.Array
    stats: SpecStats
    logprobs: LogprobBuffers | None = None


def _is_stop(tokens, stop_ids_BS):
    """tokens [B, ...] -> [B, ...] bool: the token ends its row."""
    extra = (None,) * (tokens.ndim - 1)
    return jnp.any(tokens[..., None] == stop_ids_BS[(slice(None),) + extra + (slice(None),)], axis=-1)


def _record_logprobs(buffers: LogprobBuffers | None, logits_BQV, tokens_BQ, slots_BQ) -> LogprobBuffers | None:
    if buffers is None:
        return None
    b, q, v = logits_BQV.shape
    k = buffers.top_ids.shape[2]
    chosen, top_ids, top_vals = token_logprobs(logits_BQV.reshape(b * q, v), tokens_BQ.reshape(b * q), k)
    rows = jnp.arange(b)[:, None]
    return LogprobBuffers(buffers.sampled.at[rows, slots_BQ].set(chosen.reshape(b, q), mode="drop"),
                          buffers.top_ids.at[rows, slots_BQ].set(top_ids.reshape(b, q, k), mode="drop"),
                          buffers.top_vals.at[rows, slots_BQ].set(top_vals.reshape(b, q, k), mode="drop"))


def init_spec_loop(graphdef, params, source, logits_BV, hidden_BTD, state: DecodeState, ids_BT, valid_BT, extra,
                   inputs: LoopInputs, done_B, *, max_tokens: int, pad_id: int, logprobs_k: int,
                   filters: bool) -> SpecLoopState:
    """The carry after the prompt's prefill: samples the first token from logits_BV [B, Vocab],
    checks it against the stop conditions and asks `source` for the first drafts.
    extra: the source's initial state argument (see each source's `init`)."""
    b = logits_BV.shape[0]
    live = ~done_B
    first = jnp.where(done_B, pad_id, sample(logits_BV, inputs.sampler, inputs.prompt_len, filters=filters))
    stopped = live & _is_stop(first, inputs.stop_ids)
    at_limit = live & ~stopped & (inputs.max_new <= 1)
    tokens = jnp.full((b, max_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    logprobs = None
    if logprobs_k:
        buffers = LogprobBuffers(sampled=jnp.zeros((b, max_tokens), jnp.float32),
                                 top_ids=jnp.zeros((b, max_tokens, logprobs_k), jnp.int32),
                                 top_vals=jnp.zeros((b, max_tokens, logprobs_k), jnp.float32))
        logprobs = _record_logprobs(buffers, logits_BV[:, None], first[:, None], jnp.zeros((b, 1), jnp.int32))
    prompt = PromptView(ids=ids_BT, valid=valid_BT, hidden=hidden_BTD, first=first)
    drafts, source_state = source.init(graphdef, params, prompt, extra)
    finish = jnp.where(stopped, STOPPED, jnp.where(at_limit, LENGTH, RUNNING)).astype(jnp.int32)
    stats = SpecStats(steps=jnp.zeros((b,), jnp.int32), accepted_at=jnp.zeros((b, source.k), jnp.int32))
    return SpecLoopState(state=state, pending=first, drafts=drafts, source=source_state, tokens=tokens,
                         count=live.astype(jnp.int32), done=done_B | stopped | at_limit, finish=finish,
                         step=jnp.zeros((), jnp.int32), stats=stats, logprobs=logprobs)


def spec_decode_chunk(graphdef, params, source, carry: SpecLoopState, inputs: LoopInputs, step_limit, *,
                      filters: bool) -> SpecLoopState:
    """Verify steps until every row is done or `carry.step` reaches `step_limit`.
    source (static): the draft source; filters (static): apply top-k / top-p."""

    def cond(c: SpecLoopState):
        return (c.step < step_limit) & ~jnp.all(c.done)

    def body(c: SpecLoopState) -> SpecLoopState:
        b, width = c.tokens.shape
        k = c.drafts.shape[1]
        rows = jnp.arange(b)
        live = ~c.done
        window = jnp.concatenate([c.pending[:, None], c.drafts], axis=1)
        start = c.state.lengths
        logits, hidden, pending_state = verify_step(graphdef, params, c.state, window)
        with jax.named_scope("acceptance"):
            target, accepted = verify_tokens(logits, c.drafts, inputs.sampler, inputs.prompt_len + c.count,
                                             filters=filters)
            j = jnp.arange(k + 1)[None, :]
            stops = _is_stop(target, inputs.stop_ids) & (j <= accepted[:, None])
            first_stop = jnp.min(jnp.where(stops, j, k + 1), axis=1)
            emitted = jnp.minimum(jnp.minimum(accepted + 1, first_stop + 1), inputs.max_new - c.count)
            emitted = jnp.where(live, emitted, 0)
            kept_drafts = jnp.maximum(emitted - 1, 0)  # accepted drafts that reach the output
            stopped = live & (first_stop < emitted)
            at_limit = live & ~stopped & (c.count + emitted >= inputs.max_new)
            slots = jnp.where(j < emitted[:, None], c.count[:, None] + j, width)
            tokens = c.tokens.at[rows[:, None], slots].set(target, mode="drop")
            logprobs = _record_logprobs(c.logprobs, logits, target, slots)
            count = c.count + emitted
        with jax.named_scope("commit"):
            state = commit_step(graphdef, params, pending_state, start, jnp.where(live, accepted + 1, 0))
        outcome = VerifyOutcome(hidden=hidden, target=target, accepted=accepted, start=start, emitted=emitted,
                                count=count)
        with jax.named_scope("draft"):
            drafts, source_state = source.next(graphdef, params, c.source, outcome)
        stats = SpecStats(steps=c.stats.steps + live.astype(jnp.int32),
                          accepted_at=c.stats.accepted_at + (live[:, None] & (j[:, :k] < kept_drafts[:, None])))
        finish = jnp.where(stopped, STOPPED, jnp.where(at_limit, LENGTH, c.finish))
        return SpecLoopState(state=state, pending=jnp.take_along_axis(target, accepted[:, None], axis=1)[:, 0],
                             drafts=drafts, source=source_state, tokens=tokens, count=count,
                             done=c.done | stopped | at_limit, finish=finish, step=c.step + 1, stats=stats,
                             logprobs=logprobs)

    return jax.lax.while_loop(cond, body, carry)
