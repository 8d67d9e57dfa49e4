"""Host-side checks of model inputs, run before anything is dispatched: one clear ValueError that
names the problem."""

from __future__ import annotations

import numpy as np


def check_token_ids(token_ids, vocab_size: int, name: str = "token_ids") -> np.ndarray:
    """Integer ids inside [0, vocab_size) -> int32 array of the same shape."""
    try:
        ids = np.asarray(token_ids)
    except ValueError:
        raise ValueError(f"{name} must be a rectangular array of integer token ids") from None
    if ids.size == 0:
        raise ValueError(f"{name} is empty")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"{name} holds id {int(bad.flat[0])} outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)


def check_batch(token_ids, attention_mask, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """([B, T] int32 ids, [B, T] bool mask) from ids [B, T] or [T] and a 0/1 left-padded mask or None."""
    ids = check_token_ids(token_ids, vocab_size)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"token_ids must be [B, T] (or [T]), got shape {ids.shape}")
    if attention_mask is None:
        return ids, np.ones(ids.shape, bool)
    mask = np.asarray(attention_mask)
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} does not match token_ids shape {ids.shape}")
    if not np.isin(mask, (0, 1)).all():
        raise ValueError("attention_mask must contain only 0 and 1")
    mask = mask.astype(bool)
    if not mask.any(axis=1).all():
        raise ValueError(f"attention_mask row {int(np.argmin(mask.any(axis=1)))} has no real token")
    if (np.diff(mask.astype(np.int8), axis=1) < 0).any():
        raise ValueError("attention_mask must be left-padded (padding before the real tokens of each row)")
    return ids, mask
