"""The Hopper MXFP4 grouped matmul as one persistent, warp-specialized program per multiprocessor
(`HopperMxfp4Blocks(launch="persistent")`).

The grid launch (`hopper_mxfp4`) starts a program per tile and 64-column block: at decode each program
streams only a few pipeline steps (K / block_k: 9 for Kimi-Linear's gate and up, 4 for its down
projection), so every program pays the latency of its first copies and leaves its ring empty at the end,
and one warpgroup both waits for the copies and decodes. Here each of `programs` programs walks its share
of the work items (a tile of sorted rows x a block of 128 columns; item i of program p is p + i x programs,
so programs read neighbouring items at the same time) as one pipeline of items x steps, so the copies of an
item's first steps are in flight while the item before it is multiplied:

* a memory warpgroup issues the TMA copies of the tile's activations and the block's codes and scales into
  a ring of `stages` buffers, item after item without a pause;
* two compute warpgroups each decode and multiply 64 of the block's 128 columns
  (`hopper_mxfp4_step.multiply_step`, the grid launch's step), and at an item's last step write its products
  out (a [64, rows] fp32 block per weight, or its rows: `HopperMxfp4Blocks.outputs`) and clear their
  accumulators.

Takes the activations as slabs (`activations="slab"`) and sorted rows only (pairs keep the grid launch);
the output is the grid launch's with one split, so `hopper_mxfp4` finishes both the same way. With a `GluSpec`
(gate and up weights) each compute warpgroup ends an item with the GLU epilogue instead
(`hopper_mxfp4_step.write_glu_slab`), writing h's bf16 slabs for the down launch as the grid launch does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe_gmm.activation import GluSpec
from pallas_kernels.moe_gmm.hopper_mxfp4_step import (CODE_TRANSFORMS, COLUMNS, X_TRANSFORMS, copy_out_rows,
                                                      launch_name, multiply_step, write_glu_slab)
from pallas_kernels.moe_gmm.mxfp4 import GROUP

COMPUTE_WARPGROUPS = 2            # each takes 64 of an item's columns
BLOCK_COLUMNS = COMPUTE_WARPGROUPS * COLUMNS
MEMORY_REGISTERS = 40             # the copy-issuing warpgroup's registers a thread (as JAX's Hopper matmuls)


def persistent_takes(n_dim: int) -> bool:
    """Whether N splits into whole blocks of the two compute warpgroups' columns."""
    return n_dim % BLOCK_COLUMNS == 0


def smem_bytes(rows: int, block_k: int, stages: int, n_weights: int, outputs: str, a_operand: str,
               inputs_per_mma: int) -> int:
    """Shared memory of one program: the ring (per buffer the tile's activations and each weight's codes and
    scales for 128 columns), each compute warpgroup's staged products (and their transposed copy with
    `outputs="rows"`, the decoded-operand buffer with `a_operand="smem"`), and barriers and alignment."""
    per_stage = rows * block_k * 2 + n_weights * BLOCK_COLUMNS * (block_k // 2 + block_k // GROUP)
    staged = n_weights * COLUMNS * rows * 4 * (2 if outputs == "rows" else 1)
    operand = COLUMNS * inputs_per_mma * 2 if a_operand == "smem" else 0
    return stages * per_stage + COMPUTE_WARPGROUPS * (staged + operand) + 2048


def _kernel(sched_ref, count_ref, x_ref, *refs, n_weights: int, steps: int, column_blocks: int, programs: int,
            blocks, glu_spec: GluSpec | None = None):
    """sched_ref [4, tiles]: each tile's group, first and end row and the output row of its first row, the
    live tiles first; count_ref [1]: how many are live; x_ref [tiles, rows, K] bf16 slabs (inputs in
    `hopper_mxfp4.k_order`); refs: per weight packed [G, N, K/2] and scale [G, K/32, N], then the output
    (fp32 [weights, 1, tiles, N, rows], or with `outputs="rows"` [1, rows out, weights, N], or with `glu_spec`
    h's bf16 slabs [tiles, rows, N]) and the scratch: staged products [2, weights, 64, rows] (with `glu_spec`:
    h's [2, rows, 64] bf16), their transposed copy [2, rows, weights, 64] (`outputs="rows"`), the decoded operand
    [2, 64, inputs] (`a_operand="smem"`); the leading 2: the compute warpgroup."""
    w_refs, (out_ref, o_smem, *scratch) = refs[:2 * n_weights], refs[2 * n_weights:]
    t_smem = scratch.pop(0) if blocks.outputs == "rows" and glu_spec is None else None   # glu: o_smem holds h
    a_smem = scratch.pop(0) if blocks.a_operand == "smem" else None
    program, wg = lax.axis_index("program"), lax.axis_index("wg")
    window = blocks.rows
    items = count_ref[0] * column_blocks
    mine = (items - program + programs - 1) // programs      # program <= programs - 1: never negative

    def place(i):
        """Item i of this program -> (its tile, its block of 128 columns)."""
        item = program + i * programs
        return item // column_blocks, item % column_blocks

    def group(i):
        return sched_ref[0, place(i)[0]]

    half, groups = blocks.block_k // 2, blocks.block_k // GROUP
    in_specs = [plgpu.BlockSpec((None, window, blocks.block_k), lambda i, kk: (place(i)[0], 0, kk),
                                transforms=X_TRANSFORMS)]
    for _ in range(n_weights):
        in_specs += [plgpu.BlockSpec((None, BLOCK_COLUMNS, half), lambda i, kk: (group(i), place(i)[1], kk),
                                     transforms=CODE_TRANSFORMS),
                     plgpu.BlockSpec((None, groups, BLOCK_COLUMNS), lambda i, kk: (group(i), kk, place(i)[1]))]
    columns = pl.ds(pl.multiple_of(wg * COLUMNS, COLUMNS), COLUMNS)

    def write_out(i, accs):
        tile, block = place(i)
        col = block * COMPUTE_WARPGROUPS + wg                  # this warpgroup's 64-column block of N
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)        # its copies of the item before have read o_smem
        if glu_spec is not None:
            write_glu_slab(*accs, o_smem.at[wg], out_ref.at[tile, :, pl.ds(col * COLUMNS, COLUMNS)], glu_spec)
            return
        for w, acc in enumerate(accs):
            o_smem.at[wg, w][...] = acc
        plgpu.commit_smem()
        if blocks.outputs == "rows":
            first, last, out_first = sched_ref[1, tile], sched_ref[2, tile], sched_ref[3, tile]
            copy_out_rows(o_smem.at[wg], t_smem.at[wg], out_ref.at[0], 0, last - first, out_first, col, window,
                          blocks.rows)
        else:
            for w in range(n_weights):
                plgpu.copy_smem_to_gmem(o_smem.at[wg, w], out_ref.at[w, 0, tile, pl.ds(col * COLUMNS, COLUMNS)])

    def body(idx, x_smem, *rest):
        *w_smem, accs = rest
        i, kk = idx

        def multiply(acc_refs):
            multiply_step(x_smem, w_smem, acc_refs, block_k=blocks.block_k, decode=blocks.decode,
                          mma_inputs=blocks.inputs_per_mma, a_smem=None if a_smem is None else a_smem.at[wg],
                          columns=columns, code_load=blocks.code_load)

        accs = pl.run_state(multiply)(tuple(plgpu.ACC.init(acc) for acc in accs))
        last_step = kk == steps - 1
        pl.when(last_step)(lambda: write_out(i, accs))
        clear = jnp.broadcast_to(last_step, (COLUMNS, window))                  # the next item starts from zero
        return tuple(lax.select(clear, jnp.zeros_like(acc), acc) for acc in accs)

    def compute(run):
        zeros = plgpu.layout_cast(jnp.zeros((COLUMNS, window), jnp.float32), plgpu.Layout.WGMMA)
        run((zeros,) * n_weights)
        plgpu.wait_smem_to_gmem(0)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        body, grid=(mine, steps), memory_registers=MEMORY_REGISTERS, in_specs=in_specs,
        max_concurrent_steps=blocks.stages, wg_axis="wg", num_compute_wgs=COMPUTE_WARPGROUPS,
        compute_context=compute)
    pipeline(x_ref, *w_refs)


def launch_persistent(sched, x, weights, rows_out: int, blocks, interpret: bool, programs: int,
                      glu_spec: GluSpec | None = None):
    """The persistent launch of `hopper_mxfp4.launch` for sorted rows in slabs: sched [4, T] (live tiles
    first), x [T, rows, K] bf16 -> fp32 [weights, 1, T, N, rows] (`outputs="tiles"`) or [1, rows_out,
    weights, N] (`outputs="rows"`), or with `glu_spec` (gate and up) h's bf16 slabs [T, rows, N] (tiles past
    the live ones not written); `programs` programs."""
    tiles, k = sched.shape[1], x.shape[-1]
    n, n_weights, window = weights[0].shape[2], len(weights), blocks.rows
    count = jnp.sum(sched[1] < sched[2]).astype(jnp.int32)[None]
    kernel = functools.partial(_kernel, n_weights=n_weights, steps=k // blocks.block_k,
                               column_blocks=n // BLOCK_COLUMNS, programs=programs, blocks=blocks, glu_spec=glu_spec)
    by_rows = blocks.outputs == "rows" and glu_spec is None
    if glu_spec is not None:
        out_type = jax.ShapeDtypeStruct((tiles, window, n), jnp.bfloat16)
        scratch = [plgpu.SMEM((COMPUTE_WARPGROUPS, window, COLUMNS), jnp.bfloat16)]
    else:
        out_type = jax.ShapeDtypeStruct((1, rows_out, n_weights, n) if by_rows else (n_weights, 1, tiles, n, window),
                                        jnp.float32)
        scratch = [plgpu.SMEM((COMPUTE_WARPGROUPS, n_weights, COLUMNS, window), jnp.float32)]
    if by_rows:
        scratch.append(plgpu.SMEM((COMPUTE_WARPGROUPS, window, n_weights, COLUMNS), jnp.float32))
    if blocks.a_operand == "smem":
        scratch.append(plgpu.SMEM((COMPUTE_WARPGROUPS, COLUMNS, blocks.inputs_per_mma), jnp.bfloat16,
                                  transforms=X_TRANSFORMS))
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(programs,),
        grid_names=("program",),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        kernel_name=launch_name(n_weights, glu_spec is not None, persistent=True),
        scratch_types=scratch,
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(sched, count, x, *(part for w in weights for part in (w.packed, w.scale)))
