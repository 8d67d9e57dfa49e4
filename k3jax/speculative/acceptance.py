"""The acceptance decision of a verify step, on the device.

Drafts are single proposals (a one-hot draft distribution), so the standard rejection rule that
keeps the target distribution reduces to: accept draft d at window position j with probability
p_j(d); when rejected, draw from p_j with d removed. Greedy rows accept while the draft equals the
argmax, which makes their output identical to non-speculative greedy decoding. p_j is the
distribution sampling draws from (temperature, top-k, top-p: `k3jax.sampling.sampling_logits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.sampling import SamplerInputs, sampling_keys, sampling_logits


def verify_tokens(logits_BQV: jax.Array, drafts_BK: jax.Array, sampler: SamplerInputs, position_B: jax.Array, *,
                  filters: bool) -> tuple[jax.Array, jax.Array]:
    """Decides a verify window of q = k + 1 positions per row.

    Args:
      logits_BQV: [B, Q, Vocab] target logits after window token j (the pending token, then draft j).
      drafts_BK: [B, K] int32 the drafts (token j + 1 of the window).
      sampler: per-row SamplerInputs. position_B: [B] sampling position of window position 0
        (prompt length + tokens generated before it); position j uses position_B + j.
      filters (static): apply top-k / top-p.
    Returns:
      (target [B, Q] int32: the token the target emits at each position given that every earlier
       draft was accepted (the draft itself where accepted, else the correction; position K is
       the bonus token), accepted [B] int32: leading drafts accepted, 0..K)
    """
    b, q, v = logits_BQV.shape
    k = q - 1
    per_position = lambda x: jnp.repeat(x, q, axis=0)
    flat_sampler = jax.tree.map(per_position, sampler)
    flat_logits = logits_BQV.reshape(b * q, v)
    draft = jnp.concatenate([drafts_BK, jnp.full((b, 1), -1, jnp.int32)], axis=1).reshape(b * q)
    positions = (position_B[:, None] + jnp.arange(q)[None, :]).reshape(b * q)

    greedy = jnp.argmax(flat_logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    scaled = sampling_logits(flat_logits, flat_sampler, filters=filters)
    probs = jax.nn.softmax(scaled, axis=-1)
    has_draft = draft >= 0
    safe_draft = jnp.maximum(draft, 0)
    p_draft = jnp.where(has_draft, jnp.take_along_axis(probs, safe_draft[:, None], axis=-1)[:, 0], 0.0)
    keys = sampling_keys(flat_sampler, positions)
    accept_keys, draw_keys = jax.vmap(lambda key: tuple(jax.random.split(key)))(keys)
    u = jax.vmap(jax.random.uniform)(accept_keys)
    vocab = jnp.arange(v)[None, :]
    residual = jnp.where(has_draft[:, None] & (vocab == safe_draft[:, None]), -jnp.inf, scaled)
    drawn = jax.vmap(jax.random.categorical)(draw_keys, residual).astype(jnp.int32)
    sampled = jnp.where(has_draft & (u < p_draft), draft, drawn)
    target = jnp.where(flat_sampler.temperature > 0, sampled, greedy).reshape(b, q)

    matches = (target[:, :k] == drafts_BK).astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(matches, axis=1), axis=1).astype(jnp.int32)
    return target, accepted
