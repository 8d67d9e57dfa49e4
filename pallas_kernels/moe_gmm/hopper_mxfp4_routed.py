"""The routed experts' whole output from unsorted token-expert pairs through the GLU hand-off
(`routed_mlp_hopper_mxfp4`), with the glue around the two Mosaic GPU launches cut to what the data flow needs.

`grouped_mlp_hopper_mxfp4` takes rows already sorted by expert. Around it, a caller gathers x's rows into sorted
order, gathers the routing weights into sorted order, and afterwards puts the rows back in token order and sums
each token's. Inside it, the sorted rows are put in `k_order` and gathered again into slabs, and rows past the
groups are masked to zero. Here instead:

- the pairs are ordered (`routing_order`) by counting, for each pair, the pairs before it in (expert, pair)
  order: one [P, P] comparison reduced (one fusion expected), for up to `COUNT_MAX_PAIRS` pairs (decode). Past that, by
  one single-operand sort of (expert, pair) packed into one int32 key (XLA's stable argsort sorts two operands;
  its sort of 512 keys took 5 us on an H100, in five kernels with the packing and unpacking around it);
- the tiles are counted from the experts themselves (`schedule.tile_schedule_of_keys`): no group sizes and no
  cumulative sums;
- x's inputs are put in `k_order` on its N token rows, not the N*X sorted ones, and each slab row is gathered
  straight from them through the sort (sorted row r is token order[r] // X): one gather builds the slabs;
- the down launch's products are read back per pair in token order (pair p at sorted row rank[p]) and summed
  with the routing weights in one fusion: no sorted weights, no masked [N*X, D'] rows in between.

Same math as `sort_by_expert`, `grouped_mlp_hopper_mxfp4(.., hand_off="glu")` and `unsort_and_sum` with the same
settings (tests/pallas_kernels/test_moe_gmm_hopper_mxfp4_routed.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.moe_gmm.activation import GluSpec
from pallas_kernels.moe_gmm.hopper_mxfp4 import (HandOffColumns, Mxfp4Columns, check_operands, launch,
                                                 products_by_row, sorted_inputs)
from pallas_kernels.moe_gmm.hopper_mxfp4_mlp import hand_off_settings
from pallas_kernels.moe_gmm.schedule import tile_schedule_of_keys

_INT32_MAX = 2 ** 31 - 1
COUNT_MAX_PAIRS = 1024          # `routing_order`'s "auto": count up to this many pairs ([P, P] comparisons), else sort
ORDER_METHODS = ("auto", "count", "sort")


def routing_order(key, num_keys: int, method: str = "auto"):
    """(order [P]: the pairs sorted by key, ties in pair order; rank [P]: pair p's sorted row, order's inverse)
    for keys [P] int32 in [0, num_keys).

    method: "count": rank[p] is the number of pairs before p in (key, pair) order, one [P, P] comparison reduced (one
    fusion expected), and order its inverse by a scatter; "sort" (the reference): one single-operand sort of key * P + p
    (unique values, so the order is stable) where that fits in int32, else XLA's stable argsort of the keys, and
    rank its inverse by a scatter; "auto": "count" up to `COUNT_MAX_PAIRS` pairs, else "sort"."""
    if method not in ORDER_METHODS:
        raise ValueError(f"routing_order: method must be one of {ORDER_METHODS}, got {method!r}")
    p = key.shape[0]
    key = key.astype(jnp.int32)
    index = jnp.arange(p, dtype=jnp.int32)

    def inverse(perm):                                    # the permutation q with q[perm[i]] = i
        return jnp.zeros_like(perm).at[perm].set(index, unique_indices=True)

    if method == "count" or (method == "auto" and p <= COUNT_MAX_PAIRS):
        mine, theirs = key[:, None], key[None, :]
        rank = jnp.sum((theirs < mine) | ((theirs == mine) & (index[None, :] < index[:, None])), axis=1,
                       dtype=jnp.int32)
        return inverse(rank), rank
    if num_keys * p <= _INT32_MAX:
        order = lax.sort(key * p + index) % p
    else:
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
    return order, inverse(order)


@functools.partial(jax.jit, static_argnames=("spec", "blocks", "interpret", "order_by"))
def routed_mlp_hopper_mxfp4(x, weights, experts, w_gate: HandOffColumns, w_up: HandOffColumns, w_down: Mxfp4Columns,
                            *, spec: GluSpec = GluSpec(), blocks=None, interpret: bool | None = None,
                            order_by: str = "auto"):
    """y[n] = sum_j weights[n, j] * act(x[n] @ W_gate[e], x[n] @ W_up[e]) @ W_down[e], e = experts[n, j], over the
    pairs whose expert is one of this call's [0, G); the others (another shard's experts) add nothing.

    Args:
      x: [N, D] (rounded to bf16 for the MMA). weights: [N, X] routing weights. experts: [N, X] int, the expert of
        each pair; a value outside [0, G) marks a pair this call does not hold.
      w_gate, w_up: `HandOffColumns` of [G, D, F] (`hand_off_columns`); w_down: `Mxfp4Columns` of [G, F, D'].
      spec: the GLU. blocks: both launches' settings as `grouped_mlp_hopper_mxfp4` takes them (default each
        projection's `HopperMxfp4Blocks.for_backend` for N*X rows). interpret: default off the GPU.
      order_by: how the pairs are put in expert order (`routing_order`'s method: "auto", "count", "sort").
    Returns:
      [N, D'] fp32.
    """
    if x.ndim != 2 or experts.ndim != 2 or x.shape[0] != experts.shape[0] or weights.shape != experts.shape:
        raise ValueError(f"routed_mlp_hopper_mxfp4: expected x [N, D] with weights and experts [N, X]; got x "
                         f"{x.shape}, weights {weights.shape}, experts {experts.shape}")
    n, k = experts.shape
    g, p = w_gate.shape[0], experts.size
    rows = jax.ShapeDtypeStruct((p, x.shape[1]), x.dtype)          # the sorted rows the launches take
    up_blocks, down_blocks, interpreted = hand_off_settings(blocks, interpret, rows, w_gate, w_down, "glu",
                                                            "routed_mlp_hopper_mxfp4")
    sizes_like = jax.ShapeDtypeStruct((g,), jnp.int32)
    check_operands(rows, (w_gate, w_up), sizes_like, up_blocks, permuted=True)
    f = w_gate.shape[2]
    if w_down.shape[:2] != (g, f) or isinstance(w_down, HandOffColumns):
        raise ValueError(f"routed_mlp_hopper_mxfp4: w_down must be plain Mxfp4Columns of [{g}, {f}, D'] after w_gate "
                         f"{w_gate.shape}, got {type(w_down).__name__} of {w_down.shape}")
    check_operands(jax.ShapeDtypeStruct((p, f), jnp.bfloat16), (w_down,), sizes_like, down_blocks)

    flat = experts.reshape(-1)
    local = (flat >= 0) & (flat < g)
    key = jnp.where(local, flat, g).astype(jnp.int32)                  # other shards' pairs sort last
    order, rank = routing_order(key, g + 1, order_by)
    tiles = tile_schedule_of_keys(key, g, up_blocks.rows)
    sched = jnp.concatenate([tiles, tiles[1:2]])            # `sorted_schedule`'s [4, T]: a tile's rows are its own
    # Each tile's slab straight from x (x's inputs put in `k_order` on its N rows, not the N*X sorted ones): sorted
    # row r is token order[r] // X.
    slabs, _ = sorted_inputs(x, sched, up_blocks, row_source=order // k)                 # [T, rows, D]
    h = launch(sched, slabs, (w_gate, w_up), p, up_blocks, interpreted, sorted_rows=True, glu_spec=spec)
    out = launch(sched, h, (w_down,), p, down_blocks, interpreted, sorted_rows=True)
    if down_blocks.outputs == "rows":
        by_row = out[0]          # [P, D']: row r the products of sorted row r (rows of no tile: never read)
    else:
        # (products_by_row masks the rows past the groups' by their total: the local pairs)
        by_row = products_by_row(out, sched, sched[1], jnp.sum(local, dtype=jnp.int32)[None], p, down_blocks)[0]
    # Pair p's products sit at sorted row rank[p]; pairs of other shards (past the live rows) add nothing.
    picked = jnp.where(local[:, None], by_row[rank] * weights.reshape(-1, 1).astype(jnp.float32), 0.0)
    return jnp.sum(picked.reshape(n, k, -1), axis=1)
