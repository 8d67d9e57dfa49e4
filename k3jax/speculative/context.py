"""What draft sources read: the prompt after prefill, and the outcome of each verify step."""

from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass
class PromptView:
    """The prefilled prompt. ids / valid: [B, W] left-padded prompt tokens and mask. hidden:
    [B, W, D] target pre-norm hidden states (None unless the source asked for them). first: [B]
    the first generated token (sampled from the prefill's logits, not yet in the state)."""

    ids: jax.Array
    valid: jax.Array
    hidden: jax.Array | None
    first: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class VerifyOutcome:
    """One verify step, per row. hidden: [B, Q, D] target pre-norm hidden of the window. target:
    [B, Q] the target's token at each window position (`acceptance.verify_tokens`). accepted: [B]
    leading drafts accepted. start: [B] the state's length before the window (the window's first
    position). emitted: [B] tokens appended to the output this step (target[:, :emitted]).
    count: [B] tokens generated so far, after this step."""

    hidden: jax.Array
    target: jax.Array
    accepted: jax.Array
    start: jax.Array
    emitted: jax.Array
    count: jax.Array
