"""Reference twin of the fused projections: one XLA dot per group on the concatenated weights."""

from __future__ import annotations

import jax.numpy as jnp


def fused_projections_reference(xs, weights, *, counts: tuple[int, ...], out_dtype=None):
    """Same contract as `kernel.fused_projections_pallas`."""
    out_dtype = out_dtype or xs[0].dtype
    outs, at = [], 0
    for x, c in zip(xs, counts):
        outs.append(jnp.concatenate([jnp.dot(x, w, preferred_element_type=jnp.float32)
                                     for w in weights[at:at + c]], axis=-1).astype(out_dtype))
        at += c
    return tuple(outs)
