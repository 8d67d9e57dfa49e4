"""The routed experts' whole MLP over sorted rows through the Hopper MXFP4 kernel, the gated half handing its
products to the down projection tile by tile (`grouped_mlp_hopper_mxfp4`).

Run as two calls (`grouped_glu_hopper_mxfp4`, then `grouped_matmul_hopper_mxfp4`), XLA builds the rows of h
from the gated launch's products, applies the GLU, then gathers those rows again into the down launch's
per-tile slabs. Both launches cut the same sorted rows into the same tiles, so here the gated launch writes
each tile's [F, rows] products (`outputs="tiles"`) and one elementwise pass turns them into the down launch's
slabs: act(gate, up), rounded to bf16, transposed to [rows, F] and put in the down launch's `k_order`. No gather sits
between the launches. Rows past a tile's last row are act(0, 0) = 0, as the slabs' padding is; tiles past
the live ones are never read by either launch.

Same results, bit for bit, as the two calls with the same settings (the GLU in fp32, h rounded to bf16 for
the MMA in both; with three or more K splits, up to the order XLA adds their parts in). What it trades,
untimed: the gated launch writes fp32 products for every row of a live tile (8 a tile at decode, where the
rows form writes only the tile's own) and the pass reads them for every tile of the schedule's bound, against
the gather and the GLU pass it removes.

`hand_off="glu"` removes both: each program of the gated launch applies the GLU to its tile's products and
writes them in bf16 as the down launch's slabs ([T, rows, F], `hopper_mxfp4_step.write_glu_slab`), so nothing
runs between the two launches. The slabs must be in `even_odd` order along F, and a program holds 64 consecutive
columns, so the gate and up weights come with their columns in that order (`hand_off_columns`, once, where the
weights are loaded): column j of the gated launch is then column even_odd(j) of h. The permuted weights carry
their own type (`HandOffColumns`), which every other operand and entry point (but `hopper_mxfp4_routed`'s, the
same launches from unsorted pairs) refuses instead of computing wrong rows (the products hand-off, the down weight,
the two calls, the pairs; `hopper_mxfp4.check_operands`). Same
math as the two calls for bf16 and fp32 activations (fp16 ones: the two calls round h to fp16 first); the GLU
runs in the kernel (compiled: the GPU's exp and tanh), so results agree to rounding, not bit for bit. The gated
half runs the grid launch in one split or the persistent launch (timed: run 37 in benchmarks/RESULTS.md). A down
launch that loads its codes a word at a time (`code_load="words"`) reads h in `word_order`: its gate and up columns
come from `hand_off_columns(.., code_load="words")` (`WordHandOffColumns`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.moe_gmm.activation import GluSpec, glu
from pallas_kernels.moe_gmm.hopper_mxfp4 import (HandOffColumns, HopperMxfp4Blocks, Mxfp4Columns,
                                                 WordHandOffColumns, check_operands, hand_off_order, k_order, launch,
                                                 products_by_row, resolve_blocks, sorted_inputs, sorted_schedule)

HAND_OFFS = ("products", "glu")


def hand_off_columns(w: Mxfp4Columns, code_load: str = "pairs") -> HandOffColumns:
    """A gate or up weight [G, K, N] with its output columns in the order the down launch's decoded pieces take
    h (`k_order`: `even_odd`, or `word_order` for a down launch with `code_load="words"`), as `hand_off="glu"`
    takes them: a permutation of whole columns (codes and scales) within each 32, done once where the weights are
    loaded."""
    if isinstance(w, HandOffColumns):
        raise ValueError("hand_off_columns: the weight's columns are already in a hand-off order")
    if code_load not in ("pairs", "words"):
        raise ValueError(f"hand_off_columns: code_load must be 'pairs' or 'words', got {code_load!r}")
    kind = WordHandOffColumns if code_load == "words" else HandOffColumns
    order = hand_off_order(w.shape[2], code_load)
    return kind(w.packed[:, order], w.scale[:, :, order])


def hand_off_settings(blocks, interpret, lhs, w_gate: Mxfp4Columns, w_down: Mxfp4Columns, hand_off: str,
                      caller: str = "grouped_mlp_hopper_mxfp4"):
    """(gated launch's settings, down launch's settings, interpreted): `blocks` for both (the gated one
    writing tiles; with hand_off="glu" the grid launch in one split where `splits` is 0, automatic), or each
    projection's `HopperMxfp4Blocks.for_backend` default. Both cut the same tiles: the defaults take their rows
    from the rows per group alone, the same for both. `caller`: the entry point the errors name."""
    rows_per_group = lhs.shape[0] / w_gate.shape[0]
    up, interpreted = resolve_blocks(blocks, interpret, lhs.shape[-1], rows_per_group, 2)
    down, _ = resolve_blocks(blocks, interpret, w_down.shape[1], rows_per_group, 1)
    if up.activations != "slab" or down.activations != "slab":
        raise ValueError(f"{caller}: the hand-off builds slabs; activations must be 'slab', got "
                         f"{(up if up.activations != 'slab' else down).activations!r}")
    if hand_off == "glu" and isinstance(w_gate, HandOffColumns) and (
            isinstance(w_gate, WordHandOffColumns) != (down.code_load == "words")):
        made = "words" if isinstance(w_gate, WordHandOffColumns) else "pairs"
        raise ValueError(f"{caller}: hand_off='glu' writes h's slabs in the gate and up columns' "
                         f"order (hand_off_columns(.., code_load={made!r})), which a down launch with "
                         f"code_load={down.code_load!r} does not read")
    up = dataclasses.replace(up, outputs="tiles", splits=1 if hand_off == "glu" and up.splits == 0 else up.splits)
    return up, down, interpreted


@functools.partial(jax.jit, static_argnames=("spec", "blocks", "interpret", "hand_off"))
def grouped_mlp_hopper_mxfp4(lhs, w_gate: Mxfp4Columns, w_up: Mxfp4Columns, w_down: Mxfp4Columns, group_sizes,
                             row_scale=None, *, spec: GluSpec = GluSpec(), blocks: HopperMxfp4Blocks | None = None,
                             interpret: bool | None = None, hand_off: str = "products"):
    """out[r] = act(lhs[r] @ W_gate[g(r)], lhs[r] @ W_up[g(r)]) @ W_down[g(r)] (times row_scale[r]) for rows
    sorted by group.

    Args:
      lhs: [M, D] rows sorted by group (rounded to bf16 for the MMA). w_gate, w_up: Mxfp4Columns of [G, D, F]
        (with `hand_off="glu"`, `HandOffColumns` from `hand_off_columns`); w_down: of [G, F, D'].
        group_sizes: [G] int32 (sum <= M). row_scale: optional [M] per-row factor.
      blocks: settings of both launches (the gated one always writes tiles, `outputs="tiles"`); default each
        projection's `HopperMxfp4Blocks.for_backend`. interpret: default off the GPU.
      hand_off: "products" (the gated launch's fp32 products, the GLU by XLA) or "glu" (in its epilogue).
    Returns:
      [M, D'] fp32 with row_scale, else lhs's dtype; rows past sum(group_sizes) are zero.
    """
    if hand_off not in HAND_OFFS:
        raise ValueError(f"grouped_mlp_hopper_mxfp4: hand_off must be one of {HAND_OFFS}, got {hand_off!r}")
    up_blocks, down_blocks, interpreted = hand_off_settings(blocks, interpret, lhs, w_gate, w_down, hand_off)
    check_operands(lhs, (w_gate, w_up), group_sizes, up_blocks, permuted=hand_off == "glu")
    g, f = w_gate.shape[0], w_gate.shape[2]
    if w_down.shape[:2] != (g, f):
        raise ValueError(f"grouped_mlp_hopper_mxfp4: w_down must be [{g}, {f}, D'] after w_gate {w_gate.shape}, got "
                         f"{w_down.shape}")
    check_operands(jax.ShapeDtypeStruct((lhs.shape[0], f), jnp.bfloat16), (w_down,), group_sizes, down_blocks)
    m = lhs.shape[0]
    sched = sorted_schedule(group_sizes, m, up_blocks.rows)
    x, _ = sorted_inputs(lhs, sched, up_blocks)
    if hand_off == "glu":                                                                   # [T, rows, F]
        h = launch(sched, x, (w_gate, w_up), m, up_blocks, interpreted, sorted_rows=True, glu_spec=spec)
    else:
        gate, up = launch(sched, x, (w_gate, w_up), m, up_blocks, interpreted, sorted_rows=True)   # [T, F, rows]
        h = k_order(jnp.swapaxes(glu(gate, up, spec).astype(lhs.dtype).astype(jnp.bfloat16), 1, 2), down_blocks)
    out = launch(sched, h, (w_down,), m, down_blocks, interpreted, sorted_rows=True)
    out = products_by_row(out, sched, sched[1], group_sizes, m, down_blocks)[0]
    if row_scale is None:
        return out.astype(lhs.dtype)
    return out * row_scale.astype(jnp.float32)[:, None]
