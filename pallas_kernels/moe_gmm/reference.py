"""References of the grouped matmuls: `jax.lax.ragged_dot` (exact on the CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe_gmm.activation import GluSpec, glu


def grouped_matmul_reference(lhs, rhs, group_sizes, row_scale=None):
    """lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (, row_scale [M]) -> [M, N] in lhs's dtype
    (fp32 times row_scale when given); rows past sum(group_sizes) are zero."""
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    if row_scale is None:
        return out
    return out.astype(jnp.float32) * row_scale.astype(jnp.float32)[:, None]


def grouped_glu_reference(lhs, w_gate, w_up, group_sizes, *, spec: GluSpec = GluSpec()):
    """act(lhs @ w_gate[g], lhs @ w_up[g]) per row -> [M, F] in lhs's dtype."""
    return glu(jax.lax.ragged_dot(lhs, w_gate, group_sizes), jax.lax.ragged_dot(lhs, w_up, group_sizes), spec)


def pair_matmul_reference(lhs, rhs, group, valid, row_scale=None, *, repeat: int = 1, extra=None):
    """Unsorted pairs: lhs[r // repeat] @ rhs[group[r]] (times row_scale[r]) where valid[r], else 0
    (gathers each pair's weight); `extra` [S, K, N]: groups G .. G + S - 1. -> [M, N] in lhs's dtype
    (fp32 with row_scale)."""
    if extra is not None:
        rhs = jnp.concatenate([rhs, extra], axis=0)
    out = jnp.einsum("mk,mkn->mn", jnp.repeat(lhs, repeat, axis=0), rhs[group])
    if row_scale is not None:
        out = out.astype(jnp.float32) * row_scale.astype(jnp.float32)[:, None]
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


def pair_glu_reference(lhs, w_gate, w_up, group, valid, *, spec: GluSpec = GluSpec(), repeat: int = 1, extra=None):
    """Unsorted pairs: act(x @ w_gate[group[r]], x @ w_up[group[r]]) with x = lhs[r // repeat] where
    valid[r], else 0; `extra` (gate, up) [S, K, F]: groups G .. G + S - 1."""
    if extra is not None:
        w_gate, w_up = jnp.concatenate([w_gate, extra[0]], axis=0), jnp.concatenate([w_up, extra[1]], axis=0)
    x = jnp.repeat(lhs, repeat, axis=0)
    out = glu(jnp.einsum("mk,mkn->mn", x, w_gate[group]), jnp.einsum("mk,mkn->mn", x, w_up[group]), spec)
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))
