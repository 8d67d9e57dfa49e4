"""Pure step functions of the model over (graphdef, params): no validation, no placement, no
state allocation. `CausalLM` compiles them once per model (`compile_steps`) and the compiled
decode loop (k3jax.decode_loop) calls `decode_step` inside its body, so the one-token forward
exists once.

Shapes: tokens_BT / valid_BT [B, T] (left-padded rows), tokens_B [B], logits fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.state import DecodeState, SeqInfo


def forward_logits(graphdef, params, tokens_BT, valid_BT) -> jax.Array:
    """Full forward without state: logits [B, T, Vocab]."""
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens_BT, SeqInfo.make(valid_BT), None, fresh=True)
    return model.logits(hidden)


def forward_hidden(graphdef, params, tokens_BT, valid_BT) -> jax.Array:
    """Pre-norm final hidden state [B, T, D] (after K3's output AttnRes mix)."""
    model = nnx.merge(graphdef, params)
    return model(tokens_BT, SeqInfo.make(valid_BT), None, fresh=True)[0]


def prefill(graphdef, params, tokens_BT, valid_BT, state: DecodeState, *, fresh: bool, all_logits: bool):
    """Runs T tokens per row into `state`: (logits [B, Vocab] of the last position, or [B, T, Vocab]
    with all_logits, new state). fresh: the state holds no history yet (attention over this call)."""
    model = nnx.merge(graphdef, params)
    hidden, state = model(tokens_BT, SeqInfo.make(valid_BT, state.lengths), state, fresh=fresh)
    return model.logits(hidden if all_logits else hidden[:, -1]), state


def prefill_hidden(graphdef, params, tokens_BT, valid_BT, state: DecodeState):
    """A fresh prompt into `state`, keeping what draft models read: (logits [B, Vocab] of the last
    position, pre-norm hidden [B, T, D] of every position, new state)."""
    model = nnx.merge(graphdef, params)
    hidden, state = model(tokens_BT, SeqInfo.make(valid_BT, state.lengths), state, fresh=True)
    return model.logits(hidden[:, -1]), hidden, state


def verify_step(graphdef, params, state: DecodeState, tokens_BQ):
    """A tentative window of Q tokens per row (speculative verification): (logits [B, Q, Vocab],
    pre-norm hidden [B, Q, D], pending state). Commit the tokens to keep with `commit_step`."""
    model = nnx.merge(graphdef, params)
    seq = SeqInfo.make(jnp.ones(tokens_BQ.shape, bool), state.lengths, tentative=True)
    hidden, pending = model(tokens_BQ, seq, state, fresh=False)
    return model.logits(hidden), hidden, pending


def commit_step(graphdef, params, pending: DecodeState, start_B, keep_B) -> DecodeState:
    """The state after the first keep_B[b] tokens of a verify window that started at start_B[b]."""
    return nnx.merge(graphdef, params).commit(pending, start_B, keep_B)


def decode_step(graphdef, params, state: DecodeState, tokens_B) -> tuple[jax.Array, DecodeState]:
    """One token per row: (logits [B, Vocab], new state)."""
    model = nnx.merge(graphdef, params)
    seq = SeqInfo.make(jnp.ones((tokens_B.shape[0], 1), bool), state.lengths)
    hidden, state = model(tokens_B[:, None], seq, state, fresh=False)
    return model.logits(hidden[:, 0]), state


def mtp_step(graphdef, params, hidden_BTD, tokens_BT, positions_BT, valid_BT, *, layer: int):
    """MTP draft layer `layer` over a window: (MTP pre-norm hidden [B, T, D], logits [B, T, Vocab])."""
    model = nnx.merge(graphdef, params)
    mtp = model.mtp[layer]
    h, _ = mtp.draft(hidden_BTD, tokens_BT, positions_BT, model.mtp_embedding(), SeqInfo.make(valid_BT), None,
                     fresh=True)
    return h, mtp.shared_head(h)


@dataclass(frozen=True)
class CompiledSteps:
    """The step functions of one model structure, jitted (parameters are arguments)."""

    logits: Callable
    hidden: Callable
    prefill: Callable
    prefill_donated: Callable
    prefill_hidden: Callable
    decode: Callable
    mtp: Callable


def compile_steps(graphdef) -> CompiledSteps:
    """jax.jit of every step function for `graphdef`; decode (and prefill_donated, the chunks of a
    chunked prefill) donate the state they are given."""
    bind = lambda f: functools.partial(f, graphdef)
    return CompiledSteps(
        logits=jax.jit(bind(forward_logits)),
        hidden=jax.jit(bind(forward_hidden)),
        prefill=jax.jit(bind(prefill), static_argnames=("fresh", "all_logits")),
        prefill_donated=jax.jit(bind(prefill), static_argnames=("fresh", "all_logits"), donate_argnames=("state",)),
        prefill_hidden=jax.jit(bind(prefill_hidden)),
        decode=jax.jit(bind(decode_step), donate_argnames=("state",)),
        mtp=jax.jit(bind(mtp_step), static_argnames=("layer",)),
    )
