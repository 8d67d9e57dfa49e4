"""Checks on checkpoint data: SHA-256 digests of parameter values (recorded by the converter and
re-checked by `verify`), and the non-finite check every load runs on the device.
"""

from __future__ import annotations

import hashlib
from typing import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.checkpoint.plan import listing
from k3jax.checkpoint.safetensors_io import CheckpointError


class NonFiniteError(CheckpointError):
    """Weights holding NaN or Inf (a CheckpointError; the converter deletes its partial output for it)."""


def array_digest(value: np.ndarray) -> str:
    """SHA-256 of an array's bytes (C order)."""
    return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()


def combined_digest(digests: list[str]) -> str:
    """One digest for a parameter stored in slices (stacked experts, in expert order)."""
    return hashlib.sha256("".join(digests).encode()).hexdigest()


@jax.jit
def _all_finite(values: tuple[jax.Array, ...]) -> jax.Array:
    """[N] bool: whether each array holds only finite values (one fused reduction per array)."""
    return jnp.stack([jnp.isfinite(v).all() for v in values])


def nonfinite(values: dict[Hashable, jax.Array], stacked: set) -> dict[Hashable, list[int] | None]:
    """The floating arrays among `values` that hold a NaN or Inf.

    Args:
      values: key -> array, on any device or sharding.
      stacked: keys of arrays stacked on a leading expert axis; for those the experts concerned are
        named.
    Returns:
      key -> the expert indices holding non-finite values (stacked keys) or None (other keys).
    """
    keys = [k for k, v in values.items() if jnp.issubdtype(v.dtype, jnp.floating)]
    if not keys:
        return {}
    finite = np.asarray(_all_finite(tuple(values[k] for k in keys)))
    out = {}
    for k in (k for k, ok in zip(keys, finite) if not ok):  # rare: the error path only
        v = values[k]
        per_expert = np.asarray(jnp.isfinite(v).all(axis=tuple(range(1, v.ndim)))) if k in stacked else None
        out[k] = None if per_expert is None else [int(e) for e in np.flatnonzero(~per_expert)]
    return out


def raise_nonfinite(where: str, names: list[str]) -> None:
    """Raises the one-line CheckpointError for tensors holding NaN or Inf (nothing when `names` is empty)."""
    if names:
        raise NonFiniteError(f"{where}: non-finite values (NaN or Inf) in {len(names)} tensor(s): {listing(names)}")


def expert_label(experts: list[int] | None) -> str:
    """' (expert 3)', ' (experts 3, 5)' or '' for a whole array."""
    if not experts:
        return ""
    return f" (expert{'s' if len(experts) > 1 else ''} {listing([str(e) for e in experts])})"
