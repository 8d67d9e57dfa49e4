"""The compiled decode loop: one `lax.while_loop` over decode steps with the state donated.

Stop conditions (eos / stop ids, per-row max_new_tokens) are checked on the device; nothing
returns to the host per token. With streaming, an ordered `io_callback` hands the token buffer
to the host every `stream_every` steps while the loop keeps running.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import io_callback

from k3jax.sampling import SamplerInputs, sample
from k3jax.state import DecodeState, SeqInfo

RUNNING, STOPPED, LENGTH = 0, 1, 2


@dataclass
class LoopState:
    """The while_loop carry.

    state: model decode state. logits: [B, Vocab] fp32 for the next token. tokens: [B, N] int32
    generated so far. count: [B] tokens generated per row. done: [B]. finish: [B] RUNNING /
    STOPPED / LENGTH. step: scalar loop counter.
    """

    state: DecodeState
    logits: jax.Array
    tokens: jax.Array
    count: jax.Array
    done: jax.Array
    finish: jax.Array
    step: jax.Array


jax.tree_util.register_dataclass(
    LoopState, data_fields=["state", "logits", "tokens", "count", "done", "finish", "step"], meta_fields=[])


def decode_loop(graphdef, params, state: DecodeState, logits, sampler: SamplerInputs, stop_ids, max_new,
                prompt_len, done, *, max_steps: int, filters: bool, stream_every: int = 0,
                stream: Callable | None = None, pad_id: int = 0) -> LoopState:
    """Samples up to `max_steps` tokens per row.

    Args:
      state / logits: after the prompt's prefill (logits [B, Vocab] for the first new token).
      stop_ids: [B, S] int32 ids that end a row (-1 = unused). max_new: [B] int32 per-row limits.
      prompt_len: [B] int32 prompt lengths (sampling positions). done: [B] rows to skip (padding).
      max_steps, filters, stream_every (static): buffer size, top-k/top-p on, streaming interval.
    """
    model = nnx.merge(graphdef, params)
    b = logits.shape[0]

    def cond(c: LoopState):
        return (c.step < max_steps) & ~jnp.all(c.done)

    def body(c: LoopState) -> LoopState:
        tok = sample(c.logits, sampler, prompt_len + c.count, filters=filters)
        tok = jnp.where(c.done, pad_id, tok)
        tokens = c.tokens.at[:, c.step].set(tok)
        count = c.count + (~c.done).astype(jnp.int32)
        stopped = ~c.done & jnp.any(tok[:, None] == stop_ids, axis=1)
        at_limit = ~c.done & ~stopped & (count >= max_new)
        finish = jnp.where(stopped, STOPPED, jnp.where(at_limit, LENGTH, c.finish))
        done = c.done | stopped | at_limit

        def forward(args):
            st, t = args
            seq = SeqInfo.make(jnp.ones((b, 1), bool), st.lengths)
            hidden, st = model(t[:, None], seq, st, fresh=False)
            return model.logits(hidden[:, 0]), st

        logits, state = jax.lax.cond(jnp.all(done), lambda a: (c.logits, a[0]), forward, (c.state, tok))
        out = LoopState(state, logits, tokens, count, done, finish, c.step + 1)
        if stream_every:
            flush = ((out.step % stream_every) == 0) | jnp.all(done) | (out.step == max_steps)
            jax.lax.cond(flush, lambda o: io_callback(stream, None, o.tokens, o.count, ordered=True),
                         lambda o: None, out)
        return out

    init = LoopState(state=state, logits=logits.astype(jnp.float32), tokens=jnp.full((b, max_steps), pad_id, jnp.int32),
                     count=jnp.zeros((b,), jnp.int32), done=done, finish=jnp.full((b,), RUNNING, jnp.int32),
                     step=jnp.zeros((), jnp.int32))
    return jax.lax.while_loop(cond, body, init)
