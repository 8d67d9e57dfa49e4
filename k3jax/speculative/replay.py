"""Replayed drafts, for benchmarks: a recorded continuation per row (e.g. a greedy run), each draft
deliberately replaced by a wrong token with probability `error_rate`, so that speed can be measured
against a controlled acceptance length on random weights."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.speculative.context import PromptView, VerifyOutcome


@jax.tree_util.register_dataclass
@dataclass
class Recording:
    """tokens: [B, R] int32 the recorded continuation per row. error_rate: [] fp32 chance that a
    draft is replaced by a wrong token. seed: [] uint32 of those errors (a function of the row and
    the position only, so a position is right or wrong every time it is proposed)."""

    tokens: jax.Array
    error_rate: jax.Array
    seed: jax.Array


@dataclass(frozen=True)
class ReplayDrafts:
    """Drafts read from a Recording at the row's generated count. Source state: the Recording.
    init -> (drafts [B, k], recording); next -> (drafts [B, k], recording)."""

    k: int
    vocab_size: int

    needs_hidden = False

    def _propose(self, rec: Recording, count: jax.Array) -> jax.Array:
        """Drafts for generated positions count .. count + k - 1 (the token at count - 1 is pending)."""
        b, r = rec.tokens.shape
        index = count[:, None] + jnp.arange(self.k)[None, :]
        drafts = jnp.take_along_axis(rec.tokens, jnp.minimum(index, r - 1), axis=1)
        base = jax.random.key(rec.seed)
        keys = jax.vmap(lambda row, idx: jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(base, row), i))(idx))(
            jnp.arange(b), index)
        wrong = jax.vmap(jax.vmap(jax.random.uniform))(keys) < rec.error_rate
        return jnp.where(wrong, (drafts + 1) % self.vocab_size, drafts).astype(jnp.int32)

    def init(self, graphdef, params, prompt: PromptView, rec: Recording):
        count = jnp.ones((prompt.ids.shape[0],), jnp.int32)
        return self._propose(rec, count), rec

    def next(self, graphdef, params, rec: Recording, outcome: VerifyOutcome):
        return self._propose(rec, outcome.count), rec
