"""MTP drafts: the model's own MTP layer (arch §7), chained k times.

MTP at position p reads (target pre-norm hidden at p, token at p + 1) and predicts the token at
p + 2. After prefill it runs over the whole prompt (the last pair is the first generated token);
after each verify step over the window's Q positions, where the pairs up to the last accepted one
are exact and the rest are overwritten later (its latent cache rolls back by length with the
target's). The draft after the last accepted position starts a chain: draft j + 1 comes from
(the previous MTP output, draft j) one position further on.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.speculative.context import PromptView, VerifyOutcome
from k3jax.state import SeqInfo


@dataclass(frozen=True)
class MTPDrafts:
    """The model's MTP layer as the draft source: k drafts per step, each from the MTP output of the
    position before it (a chain). Source state: the MTP layer's own latent cache (MLACache
    [B, S, R + P]), written at the target's positions, so it rolls back with the target by length.
    init -> (drafts [B, k], cache); next -> (drafts [B, k], cache)."""

    k: int

    needs_hidden = True

    def _chain(self, model, cache, h_prev_BD, first_B, base_B):
        """Drafts [B, k]: first_B (predicted by the MTP output at position base_B), then k - 1 more;
        draft j + 1 comes from the MTP step at position base + j."""
        mtp, embedding = model.mtp[0], model.mtp_embedding()
        drafts = [first_B]
        for j in range(1, self.k):
            position = (base_B + j)[:, None]
            seq = SeqInfo.make(jnp.ones((first_B.shape[0], 1), bool), base_B + j)
            h, cache = mtp.draft(h_prev_BD[:, None], drafts[-1][:, None], position, embedding, seq, cache,
                                 fresh=False)
            h_prev_BD = h[:, 0]
            drafts.append(jnp.argmax(mtp.shared_head(h_prev_BD), axis=-1).astype(jnp.int32))
        return jnp.stack(drafts, axis=1), cache

    def init(self, graphdef, params, prompt: PromptView, cache):
        """cache: the MTP layer's empty latent cache (MLACache)."""
        model = nnx.merge(graphdef, params)
        mtp = model.mtp[0]
        w = prompt.ids.shape[1]
        length = jnp.sum(prompt.valid, axis=1).astype(jnp.int32)
        following = jnp.concatenate([prompt.ids[:, 1:], prompt.first[:, None]], axis=1)
        positions = jnp.maximum(jnp.arange(w)[None, :] - (w - length)[:, None], 0)
        h, cache = mtp.draft(prompt.hidden, following, positions, model.mtp_embedding(), SeqInfo.make(prompt.valid),
                             cache, fresh=True)
        first = jnp.argmax(mtp.shared_head(h[:, -1]), axis=-1).astype(jnp.int32)
        return self._chain(model, cache, h[:, -1], first, length - 1)

    def next(self, graphdef, params, cache, outcome: VerifyOutcome):
        model = nnx.merge(graphdef, params)
        mtp = model.mtp[0]
        b, q = outcome.target.shape
        positions = outcome.start[:, None] + jnp.arange(q)[None, :]
        seq = SeqInfo.make(jnp.ones((b, q), bool), outcome.start)
        h, cache = mtp.draft(outcome.hidden, outcome.target, positions, model.mtp_embedding(), seq, cache,
                             fresh=False)
        last = jnp.take_along_axis(h, outcome.accepted[:, None, None], axis=1)[:, 0]
        first = jnp.argmax(mtp.shared_head(last), axis=-1).astype(jnp.int32)
        return self._chain(model, cache, last, first, outcome.start + outcome.accepted)
