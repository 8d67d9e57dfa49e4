"""Parameter creation helpers: every parameter carries its logical axis names.

The names (e.g. ("embed", "mlp")) are the only sharding information a layer has; the mesh mapping
lives in one rules table elsewhere.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Init = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def normal(std: float = 0.02) -> Init:
    return lambda key, shape, dtype: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def ones() -> Init:
    return lambda key, shape, dtype: jnp.ones(shape, dtype)


def zeros() -> Init:
    return lambda key, shape, dtype: jnp.zeros(shape, dtype)


def uniform(low: float, high: float) -> Init:
    return lambda key, shape, dtype: jax.random.uniform(key, shape, jnp.float32, low, high).astype(dtype)


def random_bytes(low: int, high: int) -> Init:
    """Uniform integers in [low, high) (packed codes and scales of random MXFP4 weights)."""
    return lambda key, shape, dtype: jax.random.randint(key, shape, low, high, jnp.int32).astype(dtype)


def param(rngs: nnx.Rngs, shape: Sequence[int], dtype, init: Init, axes: Sequence[str | None]) -> nnx.Param:
    """Creates an `nnx.Param` of `shape`/`dtype` with `logical_axes` metadata (one name per dim)."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), logical_axes=tuple(axes))
