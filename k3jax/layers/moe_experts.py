"""Routed-expert computation for one device (or one expert shard): the one dispatch site of the
expert op. Every implementation computes

    y[n] = sum_x weights[n, x] * down(act(gate(x_n), up(x_n)))   over the experts experts[n, x]

for the experts this shard holds ([expert_offset, expert_offset + E_local)); pairs routed to other
shards contribute nothing, so the expert-parallel wrapper (k3jax.layers.moe_parallel) can run any
of them per shard and sum.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from k3jax.layers.activation import Activation, gated_activation
from pallas_kernels.moe_gmm import (GmmImpl, dense_weight, grouped_mlp, hand_off_runs, pair_glu, pair_matmul,
                                    resolve_gmm_impl, routed_mlp_hopper_mxfp4)
from pallas_kernels.moe_gmm.hopper_mxfp4 import Mxfp4Columns

# "dense": every expert on every token (the reference); "ragged": pairs sorted by expert, grouped
# matmuls; "pairs": token-expert pairs unsorted, one kernel tile each (no sort, schedule or scatter:
# a few tokens at decode); "gather": each token's expert weights gathered (small batches); "auto":
# with the Pallas kernel (GPU) pairs up to PAIRS_MAX_TOKENS tokens and ragged beyond, otherwise
# gather up to GATHER_MAX_TOKENS tokens and ragged beyond.
ExpertImpl = Literal["ragged", "dense", "gather", "pairs", "auto"]
EXPERT_IMPLS: tuple[str, ...] = get_args(ExpertImpl)
GATHER_MAX_TOKENS = 256
# Unsorted pairs read an expert once per pair that chose it; at a few tokens repeats are rare and
# skipping the sort saves several small kernels per layer.
PAIRS_MAX_TOKENS = 8

_HIGHEST = jax.lax.Precision.HIGHEST


def _local_index(experts_NX: jax.Array, num_local: int, offset) -> tuple[jax.Array, jax.Array]:
    """(index into this shard's experts [N, X] (clipped), whether the pair is local [N, X]).
    offset None: every expert is local (no expert parallelism), nothing to compute."""
    if offset is None:
        return experts_NX, jnp.ones(experts_NX.shape, bool)
    local = experts_NX - offset
    inside = (local >= 0) & (local < num_local)
    return jnp.clip(local, 0, num_local - 1), inside


def experts_dense(x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD, act: Activation, *,
                  expert_offset=None) -> jax.Array:
    """Reference: every local expert on every token, combined with a dense [N, E] weight matrix. -> [N, D] fp32."""
    n, e = x_ND.shape[0], w1_EDF.shape[0]
    index, inside = _local_index(experts_NX, e, expert_offset)
    combine_NE = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], index].add(
        jnp.where(inside, weights_NX, 0.0))
    h_ENF = gated_activation(jnp.einsum("nd,edf->enf", x_ND, w1_EDF), jnp.einsum("nd,edf->enf", x_ND, w3_EDF), act)
    y_END = jnp.einsum("enf,efd->end", h_ENF, w2_EFD)
    return jnp.einsum("ne,end->nd", combine_NE, y_END.astype(jnp.float32), precision=_HIGHEST)


def _counted_positions(key, num_keys: int):
    """The sorted row of each pair [P] int32 for keys in [0, num_keys): the rows before its key's, plus the pairs
    before it with its key (a stable sort's positions, by counting)."""
    p = key.shape[0]
    index = jnp.arange(p, dtype=jnp.int32)
    counts = jnp.sum(key[None, :] == jnp.arange(num_keys, dtype=key.dtype)[:, None], axis=1, dtype=jnp.int32)
    starts = jnp.cumsum(counts) - counts
    earlier = jnp.sum((key[None, :] == key[:, None]) & (index[None, :] < index[:, None]), axis=1, dtype=jnp.int32)
    return starts[key] + earlier, counts


def _inverse(permutation):
    """The inverse of a permutation [P] of 0..P-1: a [P, P] comparison reduced over its rows (no scatter)."""
    index = jnp.arange(permutation.shape[0], dtype=permutation.dtype)
    return jnp.sum(jnp.where(permutation[None, :] == index[:, None], index[None, :], 0), axis=1,
                   dtype=permutation.dtype)


def sort_by_expert(experts_NX: jax.Array, num_local: int, offset=0, method: str = "sort"):
    """Orders token-expert pairs by expert, stably (pairs of one expert in token order). Pairs whose expert lies
    outside [offset, offset + num_local) (another shard's) sort last and are excluded from the group sizes.
    Returns (order [N*X], group_sizes [num_local] int32, local [N*X] bool in sorted order).
    method: "sort" (XLA's sort) or "count" (each pair's sorted row counted by [P, P] comparisons, no sort
    kernel: the same result; opt-in, for small P only: on an H100 at 64 tokens of Kimi-Linear its fusions took 9 us
    more of the call's device span than the sort, run 39)."""
    if method not in ("count", "sort"):
        raise ValueError(f"sort_by_expert: method must be 'count' or 'sort', got {method!r}")
    flat = experts_NX.reshape(-1) - offset
    local = (flat >= 0) & (flat < num_local)
    key = jnp.where(local, flat, num_local).astype(jnp.int32)
    if method == "sort":
        order = jnp.argsort(key, stable=True)
        sizes = jnp.sum(jax.nn.one_hot(key, num_local, dtype=jnp.int32), axis=0)
    else:
        position, counts = _counted_positions(key, num_local + 1)
        order, sizes = _inverse(position), counts[:num_local]
    return order, sizes, local[order]


def experts_ragged(x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD, act: Activation, *,
                   gmm: GmmImpl = "auto", expert_offset=None) -> jax.Array:
    """Token-expert pairs sorted by expert; the gated half (gate and up in one grouped op) and the
    down projection (routing weight in its epilogue) as grouped matmuls; pairs put back in token
    order and summed over the X choices. Hand-off weights (expert_layout="handoff") where the Mosaic GPU kernel
    runs take `routed_mlp_hopper_mxfp4`: the gated launch hands h's slabs to the down launch. -> [N, D] fp32."""
    n, k = experts_NX.shape
    if hand_off_runs(w1_EDF, w3_EDF, w2_EFD, gmm):
        # The Mosaic GPU kernel's GLU hand-off from the unsorted pairs: its own sort, slabs and combine (less glue
        # than the sort and unsort here around `grouped_mlp`, the same math).
        index, inside = _local_index(experts_NX, w1_EDF.shape[0], expert_offset)
        return routed_mlp_hopper_mxfp4(x_ND, weights_NX, jnp.where(inside, index, -1), w1_EDF, w3_EDF, w2_EFD,
                                       spec=act.glu_spec)
    order, sizes, local = sort_by_expert(experts_NX, w1_EDF.shape[0], 0 if expert_offset is None else expert_offset)
    xs = x_ND[order // k]
    scale = jnp.where(local, weights_NX.reshape(-1)[order], 0.0)
    # The gated half then the down projection ([N*X, D] fp32, sorted; other shards' pairs are zero).
    y = grouped_mlp(xs, w1_EDF, w3_EDF, w2_EFD, sizes, scale, spec=act.glu_spec, impl=gmm)
    return unsort_and_sum(y, order, k)


def unsort_and_sum(y_PD, order, k: int) -> jax.Array:
    """Rows of token-expert pairs in sorted order ([N*X, D], `sort_by_expert`'s `order`) back in token order,
    summed over each token's X = k pairs -> [N, D]. Pair p sits at sorted row rank[p]: a gather that XLA fuses
    into the sum (no scatter-add into a zeroed copy)."""
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)
    return jnp.sum(y_PD[rank].reshape(order.shape[0] // k, k, -1), axis=1)


def experts_pairs(x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD, act: Activation, *,
                  gmm: GmmImpl = "auto", expert_offset=None, shared=None, summed: bool = True,
                  shared_chosen: bool = False) -> jax.Array:
    """Token-expert pairs in token order, one kernel tile per pair (no sort): the gated half and the
    down projection (routing weight in its epilogue), summed over each token's X choices. -> [N, D] fp32
    (summed=False: the weighted pairs [N, X, D] fp32, for an add that sums them itself).

    shared: optional (gate [S, D, F], up [S, D, F], down [S, F, D]) always-active experts, run as S
    more pairs per token (weight 1) in the same launches; their outputs join the sum.
    shared_chosen: the choices already end with those S pairs (ids E.., weight 1: the router
    kernel appends them, `RouterSpec.always`)."""
    n, k = experts_NX.shape
    index, inside = _local_index(experts_NX, w1_EDF.shape[0], expert_offset)
    extra = shared
    if shared is not None and not shared_chosen:
        s = shared[0].shape[0]
        ids = jnp.broadcast_to(w1_EDF.shape[0] + jnp.arange(s, dtype=index.dtype), (n, s))
        index, inside = jnp.concatenate([index, ids], axis=1), jnp.concatenate([inside, jnp.ones((n, s), bool)], axis=1)
        weights_NX = jnp.concatenate([weights_NX.astype(jnp.float32), jnp.ones((n, s), jnp.float32)], axis=1)
        k = k + s
    index, inside = index.reshape(-1), inside.reshape(-1)
    # pair p = token p // X: the kernel reads x's row for it (no repeated copy); pairs outside this
    # shard come back as zeros, so the routing weight needs no mask.
    h = pair_glu(x_ND, w1_EDF, w3_EDF, index, inside, spec=act.glu_spec, repeat=k, impl=gmm,
                 extra=None if extra is None else extra[:2])
    y = pair_matmul(h, w2_EFD, index, inside, weights_NX.reshape(-1), impl=gmm,
                    extra=None if extra is None else extra[2])
    return jnp.sum(y.reshape(n, k, -1), axis=1) if summed else y.reshape(n, k, -1)


def experts_gather(x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD, act: Activation, *,
                   expert_offset=None) -> jax.Array:
    """Gathers each token's chosen expert weights (reads only the touched experts). -> [N, D] fp32."""
    index, inside = _local_index(experts_NX, w1_EDF.shape[0], expert_offset)
    h = gated_activation(jnp.einsum("nd,nxdf->nxf", x_ND, w1_EDF[index]),
                         jnp.einsum("nd,nxdf->nxf", x_ND, w3_EDF[index]), act)
    y = jnp.einsum("nxf,nxfd->nxd", h, w2_EFD[index]).astype(jnp.float32)
    return jnp.einsum("nx,nxd->nd", jnp.where(inside, weights_NX, 0.0), y, precision=_HIGHEST)


def resolve_expert_impl(impl: ExpertImpl, tokens: int, weight_sides: tuple[int, int], gmm: GmmImpl = "auto",
                        columns: bool = False) -> str:
    """The path `local_experts` takes for `tokens` tokens on experts with [K, N] weight sides
    (`columns`: packed as `Mxfp4Columns`): "auto" picks the kernel's pairs up to PAIRS_MAX_TOKENS
    tokens and ragged beyond (the kernel reads touched experts only), without the kernel gather for
    few tokens."""
    if impl != "auto":
        return impl
    if resolve_gmm_impl(gmm, *weight_sides, columns=columns) == "pallas":
        return "pairs" if tokens <= PAIRS_MAX_TOKENS else "ragged"
    return "gather" if tokens <= GATHER_MAX_TOKENS else "ragged"


def local_experts(impl: ExpertImpl, x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD, act: Activation, *,
                  gmm: GmmImpl = "auto", expert_offset=None, shared=None, summed: bool = True,
                  shared_chosen: bool = False) -> jax.Array:
    """The routed experts' combined output [N, D] fp32 over this shard's experts (summed=False, on the
    "pairs" path only: the weighted pairs [N, X, D] fp32 unsummed).

    Args:
      impl: one of EXPERT_IMPLS. x_ND: expert inputs. weights_NX / experts_NX: the router's
        choice (fp32 weights, global expert ids). w1_EDF / w3_EDF (gate / up), w2_EFD (down): this
        shard's experts, arrays or packed `Mxfp4Weight`s / `Mxfp4Columns` (the kernels decode them;
        "gather" and "dense" dequantise first). gmm: the grouped-matmul implementation of "ragged" and "pairs".
        expert_offset: the global id of this shard's first expert; None when every expert is local.
        shared: (gate, up, down) of always-active experts folded into the "pairs" path
          (`experts_pairs`); other paths refuse it. shared_chosen: the choices already list them.
    """
    impl = resolve_expert_impl(impl, x_ND.shape[0], w1_EDF.shape[1:], gmm, isinstance(w1_EDF, Mxfp4Columns))
    if impl in ("gather", "dense"):   # the references take arrays: packed experts dequantised
        w1_EDF, w3_EDF, w2_EFD = (dense_weight(w, x_ND.dtype) for w in (w1_EDF, w3_EDF, w2_EFD))
    args = (x_ND, weights_NX, experts_NX, w1_EDF, w3_EDF, w2_EFD, act)
    if impl == "ragged":
        return experts_ragged(*args, gmm=gmm, expert_offset=expert_offset)
    if (shared is not None or not summed) and impl != "pairs":
        raise ValueError(f"routed experts: shared experts and unsummed pairs are the 'pairs' path's, not {impl!r}")
    if impl == "pairs":
        return experts_pairs(*args, gmm=gmm, expert_offset=expert_offset, shared=shared, summed=summed,
                             shared_chosen=shared_chosen)
    if impl == "gather":
        return experts_gather(*args, expert_offset=expert_offset)
    if impl == "dense":
        return experts_dense(*args, expert_offset=expert_offset)
    raise ValueError(f"routed experts: unknown impl {impl!r}; expected one of {EXPERT_IMPLS}")
