"""Residual adds of the decoder stack. At decode a branch output may arrive as fp32 partial sums
(`SplitSum`: a projection's slices of the reduction axis, or the expert pairs of each token), which
the add sums: XLA's add fusion, then the norm that reads its result; with norm impl "fused" ("auto"
on a GPU), the add and the norm in one launch (`pallas_kernels.rms_norm.add_rms_norm`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from k3jax.layers.norms import RMSNorm
from pallas_kernels.rms_norm import add_rms_norm, resolve_norm_impl


@dataclass(frozen=True)
class SplitSum:
    """A branch output of `shape` kept as partial sums: parts [S, ..., N] (axis 0) or [rows, S, N]
    (axis 1), whose fp32 sum cast to `dtype` is the output."""

    parts: jax.Array
    axis: int
    shape: tuple[int, ...]
    dtype: Any

    def value(self) -> jax.Array:
        return jnp.sum(self.parts.astype(jnp.float32), axis=self.axis).astype(self.dtype).reshape(self.shape)


def materialize(x):
    """The array behind a branch output (a SplitSum summed; arrays unchanged)."""
    return x.value() if isinstance(x, SplitSum) else x


def add(h: jax.Array, delta) -> jax.Array:
    """h + delta (a branch output: an array or a SplitSum) in h's dtype."""
    return h + materialize(delta).astype(h.dtype)


def add_norm(h: jax.Array, delta, norm: RMSNorm) -> tuple[jax.Array, jax.Array]:
    """(h + delta, norm(h + delta)): one kernel launch on the few-row path when `norm`'s impl is
    "fused", else the add (XLA sums a SplitSum's parts inside it) and `norm`."""
    if resolve_norm_impl(norm.impl) == "fused" and norm.weight[...].dtype == h.dtype:
        if isinstance(delta, SplitSum):
            parts, axis = delta.parts, delta.axis
        else:
            parts, axis = delta.astype(h.dtype)[None], 0
        return add_rms_norm(h, parts, norm.weight[...], norm.eps, parts_axis=axis, impl=norm.impl)
    h = add(h, delta)
    return h, norm(h)
