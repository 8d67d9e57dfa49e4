"""Reference twin of the fused projections: one XLA dot per group on the concatenated weights."""

from __future__ import annotations

import jax.numpy as jnp


def fused_projections_reference(xs, weights, *, counts: tuple[int, ...], out_dtype=None):
    """Same contract as `kernel.fused_projections_pallas`."""
    dtypes = tuple(out_dtype) if isinstance(out_dtype, tuple) else (out_dtype,) * len(xs)
    outs, at = [], 0
    for x, c, dtype in zip(xs, counts, dtypes):
        outs.append(jnp.concatenate([jnp.dot(x, w, preferred_element_type=jnp.float32)
                                     for w in weights[at:at + c]], axis=-1).astype(dtype or x.dtype))
        at += c
    return tuple(outs)
