"""Prompt lookup ("ngram") drafts: find the most recent earlier occurrence of the text's last n
tokens (n from ngram_max down to ngram_min) in the prompt and the output so far, and propose the
k tokens that followed it. No weights; works for any model."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.speculative.context import PromptView, VerifyOutcome


@jax.tree_util.register_dataclass
@dataclass
class History:
    """tokens: [B, L] the prompt then the generated tokens, contiguous from slot 0. length: [B]."""

    tokens: jax.Array
    length: jax.Array


def lookup(history: jax.Array, length: jax.Array, *, k: int, ngram_min: int, ngram_max: int) -> jax.Array:
    """Drafts [B, k] from history [B, L] of `length` [B] tokens. A row without any match proposes
    its last token repeated (it costs only acceptance)."""
    b, size_l = history.shape
    ends = jnp.arange(size_l)[None, :]
    last = jnp.take_along_axis(history, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
    best = jnp.full((b,), -1, jnp.int32)
    for n in range(ngram_max, ngram_min - 1, -1):
        match = (ends >= n - 1) & (ends <= length[:, None] - 2)
        for offset in range(n):
            wanted = jnp.take_along_axis(history, jnp.maximum(length - 1 - offset, 0)[:, None], axis=1)
            match &= jnp.roll(history, offset, axis=1) == wanted
        found = jnp.max(jnp.where(match, ends, -1), axis=1).astype(jnp.int32)
        best = jnp.where((best < 0) & (length > n), found, best)
    follow = best[:, None] + 1 + jnp.arange(k)[None, :]
    follow = jnp.minimum(follow, length[:, None] - 1)
    drafts = jnp.take_along_axis(history, jnp.maximum(follow, 0), axis=1)
    return jnp.where(best[:, None] >= 0, drafts, last[:, None]).astype(jnp.int32)


@dataclass(frozen=True)
class NgramDrafts:
    """Static settings of the prompt-lookup source (hashable: part of the compiled loop's key)."""

    k: int
    ngram_min: int
    ngram_max: int
    capacity: int  # history slots per row: prompt width + generated tokens + one window

    needs_hidden = False

    def _propose(self, history: History) -> jax.Array:
        return lookup(history.tokens, history.length, k=self.k, ngram_min=self.ngram_min, ngram_max=self.ngram_max)

    def init(self, graphdef, params, prompt: PromptView, extra) -> tuple[jax.Array, History]:
        b, w = prompt.ids.shape
        length = jnp.sum(prompt.valid, axis=1).astype(jnp.int32)
        pad = w - length
        src = jnp.arange(self.capacity)[None, :] + pad[:, None]              # left-padded -> contiguous
        tokens = jnp.take_along_axis(prompt.ids, jnp.minimum(src, w - 1), axis=1)
        tokens = jnp.where(src < w, tokens, 0).astype(jnp.int32)
        tokens = tokens.at[jnp.arange(b), length].set(prompt.first)
        history = History(tokens=tokens, length=length + 1)
        return self._propose(history), history

    def next(self, graphdef, params, history: History, outcome: VerifyOutcome) -> tuple[jax.Array, History]:
        b, q = outcome.target.shape
        j = jnp.arange(q)[None, :]
        slots = jnp.where(j < outcome.emitted[:, None], history.length[:, None] + j, self.capacity)
        tokens = history.tokens.at[jnp.arange(b)[:, None], slots].set(outcome.target, mode="drop")
        history = History(tokens=tokens, length=history.length + outcome.emitted)
        return self._propose(history), history
