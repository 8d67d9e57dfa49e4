"""Absorbed MLA decode for Hopper with one warpgroup that only scores (`HopperMLABlocks(scoring="scorer")`).

`hopper.py`'s default has warpgroup 0 score a block, run its softmax and then add its half of P @ V, while
warpgroup 1 waits for the probabilities: the kernel runs at the pace of that chain, and a second score tile (to
score block i + 1 during block i's softmax) does not fit beside warpgroup 0's [64, 256] fp32 accumulator. Here the
roles are split so that the scorer holds no accumulator:

* warpgroup 0 holds the tile's latent queries in registers (A operand of the score MMA: 128 registers a thread
  instead of 64 KiB of shared memory), scores each block, runs the online softmax and writes the bf16
  probabilities over the block's rope columns (read only by that block's score MMA, so dead once it is done; 64
  slots x 64 columns, the shape and swizzle of P), with the rescale factor beside; it also issues the copies;
* warpgroups 1 and 2 each add P @ V for half of the 512 value columns ([64, 256] fp32 in registers), and release
  the block's slot;
* the shared memory freed by the queries and by P (now over the rope columns) holds a third ring slot (3 x 72 KiB
  at block_kv = 64, with `stages=3`): the scorer can
  run a block ahead of the value products while a copy is in flight. The queries are staged through slot 0 before
  the cache blocks reach it (block i goes to slot (i + 1) % stages).

The rope-part queries ([64, P]) stay in shared memory. Splits, ragged lengths, the values zeroed past a row's
length and the outputs ([B, splits, rows, R] normalised bf16, [B, splits, rows] base-2 log-sum-exp) are as in
`hopper.py`. Runs on NVIDIA Hopper GPUs only (the value products need `run_state`, which Mosaic GPU's interpret
mode lacks); its lowering for CUDA is checked on any host.

Not yet compiled on a GPU nor timed (RESULTS.md, after run 35): its compiled tests and `benchmarks/mla_decode.py
--impl hopper hopper-scorer` come first. The register split (SCORER_REGISTERS, VALUE_REGISTERS) is an estimate
that ptxas has not seen.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla_decode.hopper_pieces import (NEG, TILE_ROWS, launch_over_tiles, query_limits, softmax_step,
                                                    split_blocks, zero_value_tail)

# Registers a thread after `setmaxnreg` (scorer, each value warpgroup), by where the scorer's latent queries live.
# The three warpgroups share what the launch gave (3 x 168: 65,536 registers over 384 threads, in steps of 8);
# asking for more than that waits forever. ptxas ignores every `setmaxnreg` when one of them is below what its code
# needs: 200 / 152 was ignored (the value code needs more than 152), so all ran at 168 and ptxas serialised every
# MMA. 184 / 160 is honoured, but 184 still spills beside 128 registers of queries (local ptxas 13.0 on the PTX
# of run 36). With the queries in shared memory the scorer holds one [64, 64] fp32 score tile.
REGISTERS = {True: (184, 160), False: (120, 192)}
LAUNCH_REGISTERS = 168


def queries_in_registers(stages: int) -> bool:
    """Whether the scorer keeps its latent queries in registers: only where the ring leaves no shared memory for
    them (stages >= 3 at block_kv = 64)."""
    return stages >= 3


def scorer_smem_bytes(width: int, latent_dim: int, block_kv: int, stages: int) -> int:
    """Shared memory of one program: the ring, the queries (only the rope part when the latent part is kept in
    registers), a rescale factor per slot, and barriers and alignment (2 KB)."""
    queries = width - latent_dim if queries_in_registers(stages) else width
    return 2 * stages * block_kv * width + 2 * TILE_ROWS * queries + 4 * stages * TILE_ROWS + 2048


def _kernel(len_ref, q_refs, c_ref, o_ref, lse_ref, scoped, *, heads, sq, r, bkv, stages, split_len, scale, n_slots,
            q_copy_rows):
    (kv_smem, *staged, out_smem), q_pe_smem, alpha_smem, (q_bar, kv_bars, ready, consumed, done), *own = scoped
    registers = bool(staged)             # the latent queries staged through slot 0, then held in registers
    q_lat_smem = (staged + own)[0]
    pe = q_pe_smem.shape[1]
    tile, split, row = lax.axis_index("tile"), lax.axis_index("split"), lax.axis_index("row")
    wg = lax.axis_index("wg")
    given_length, length, start, n_blocks = split_blocks(len_ref, row, split, split_len=split_len, bkv=bkv,
                                                         n_slots=n_slots)
    half = r // 2
    layout = plgpu.Layout.WGMMA
    row_layout = layout.reduce(1)
    offset = 1 if registers else 0
    staging = stages - offset            # blocks copied before the queries are read

    def slot_of(i):
        """Block i's ring slot; with staged queries slot 0 takes block stages - 1 first."""
        return lax.rem(i + offset, stages)

    def copy_block(i):
        slot = slot_of(i)
        plgpu.copy_gmem_to_smem(c_ref.at[row, pl.ds(start + i * bkv, bkv)], kv_smem.at[slot], kv_bars.at[slot])

    def probabilities(slot):
        """The block's P [64 query rows, bkv slots], over its rope columns."""
        return kv_smem.at[slot, :, pl.ds(r, pe)]

    def scorer():
        rows = pl.ds(tile * TILE_ROWS, q_copy_rows)
        if len(q_refs) == 1:
            srcs = q_refs[0].at[row, rows, pl.ds(0, r)], q_refs[0].at[row, rows, pl.ds(r, pe)]
        else:
            srcs = q_refs[0].at[row, rows], q_refs[1].at[row, rows]
        for src, buf in zip(srcs, (q_lat_smem, q_pe_smem)):
            plgpu.copy_gmem_to_smem(src, buf.at[pl.ds(0, q_copy_rows)], q_bar)

        @pl.loop(0, jnp.minimum(n_blocks, staging))
        def _first(i):
            copy_block(i)

        plgpu.barrier_wait(q_bar)
        q_lat = q_lat_smem
        if registers:
            q_lat = plgpu.load(q_lat_smem, layout=layout)
            plgpu.commit_smem()          # every thread has read the staged queries before the slot is refilled

            @pl.when(n_blocks > staging)
            def _():
                copy_block(staging)

        limit = query_limits(tile, given_length, heads=heads, sq=sq, n_slots=n_slots, layout=layout)
        m = plgpu.layout_cast(jnp.full((TILE_ROWS,), NEG, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.zeros((TILE_ROWS,), jnp.float32), row_layout)

        def step(i, carry):
            m, l = carry
            slot = slot_of(i)
            plgpu.barrier_wait(kv_bars.at[slot])

            def mma(s_ref):
                plgpu.wgmma(s_ref, q_lat, kv_smem.at[slot, :, pl.ds(0, r)].transpose((1, 0)))
                plgpu.wgmma(s_ref, q_pe_smem, kv_smem.at[slot, :, pl.ds(r, pe)].transpose((1, 0)))
                return s_ref[...]

            s = pl.run_scoped(mma, plgpu.ACC((TILE_ROWS, bkv), jnp.float32))
            p, alpha, m, l = softmax_step(s, start + i * bkv, limit, m, l, scale=scale, dtype=kv_smem.dtype,
                                          layout=layout)
            probabilities(slot)[...] = p
            alpha_smem.at[slot][...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(ready.at[slot])
            nxt = i - 1 + stages         # into the slot of block i - 1, once both value warpgroups released it

            @pl.when((i >= 1) & (nxt < n_blocks))
            def _():
                plgpu.barrier_wait(consumed.at[slot_of(nxt)])
                copy_block(nxt)

            return m, l

        m, l = lax.fori_loop(0, n_blocks, step, (m, l))

        @pl.loop(jnp.maximum(n_blocks - stages, 0), n_blocks)
        def _drain(i):                   # every value product done: the ring may hold the output
            plgpu.barrier_wait(consumed.at[slot_of(i)])

        seen = l > 0
        alpha_smem.at[0][...] = l
        alpha_smem.at[1][...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), NEG)
        plgpu.commit_smem()
        plgpu.barrier_arrive(done)
        plgpu.copy_smem_to_gmem(alpha_smem.at[1], lse_ref.at[row, split, pl.ds(tile * TILE_ROWS, TILE_ROWS)])
        plgpu.wait_smem_to_gmem(0)

    def values(w):
        columns = pl.ds(w * half, half)
        acc = plgpu.layout_cast(jnp.zeros((TILE_ROWS, half), jnp.float32), layout)

        def step(i, acc):
            slot = slot_of(i)
            plgpu.barrier_wait(kv_bars.at[slot])     # complete already (the scorer waited): observes the copy
            plgpu.barrier_wait(ready.at[slot])
            alpha = plgpu.load(alpha_smem.at[slot], layout=row_layout)
            for piece in range(half // 64):        # 64 columns at a time: few registers beside the accumulator
                zero_value_tail(kv_smem, slot, start + i * bkv, length, pl.ds(w * half + piece * 64, 64), bkv=bkv,
                                layout=layout)

            def add(acc_ref):
                plgpu.wgmma(acc_ref, probabilities(slot), kv_smem.at[slot, :, columns])

            acc = pl.run_state(add)(plgpu.ACC.init(acc * lax.broadcast_in_dim(alpha, acc.shape, [0])))
            plgpu.barrier_arrive(consumed.at[slot])
            return acc

        acc = lax.fori_loop(0, n_blocks, step, acc)
        plgpu.barrier_wait(done)
        l = plgpu.load(alpha_smem.at[0], layout=row_layout)
        inv = 1.0 / jnp.where(l > 0, l, 1.0)
        out_smem.at[w][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[w], o_ref.at[row, split, pl.ds(tile * TILE_ROWS, TILE_ROWS), columns])
        plgpu.wait_smem_to_gmem(0)

    def set_registers(n):
        plgpu.set_max_registers(n, action="increase" if n > LAUNCH_REGISTERS else "decrease")

    @pl.when(wg == 0)
    def _scorer():
        set_registers(REGISTERS[registers][0])
        scorer()

    @pl.when(wg > 0)
    def _values():
        set_registers(REGISTERS[registers][1])
        for w in (0, 1):
            pl.when(wg == w + 1)(functools.partial(values, w))


def launch_scorer(q_parts, cache, lengths, *, heads: int, sq: int, latent_dim: int, scale: float, block_kv: int,
                  stages: int, splits: int, split_len: int, tiles: int, out_rows: int, q_copy_rows: int):
    """The kernel launch over a grid (B, splits, `tiles` of 64 query rows). q_parts: (rows [B, >= whole tiles, R +
    P],) laid out, or (q_lat [B, Sq*H, R], q_pe [B, Sq*H, P]) read in place, `q_copy_rows` rows a copy. Returns (o [B,
    splits, out_rows, R] in the cache dtype, lse [B, splits, out_rows] fp32), `hopper.combine_splits`'s inputs."""
    _, s, width = cache.shape
    r = latent_dim
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = functools.partial(_kernel, heads=heads, sq=sq, r=r, bkv=block_kv, stages=stages, split_len=split_len,
                               scale=scale, n_slots=s, q_copy_rows=q_copy_rows)
    n_parts = len(q_parts)
    registers = queries_in_registers(stages)
    q_lat = [plgpu.SMEM((TILE_ROWS, r), cache.dtype, transforms=transforms)]
    staged_queries, own_queries = (q_lat, []) if registers else ([], q_lat)

    def entry(len_ref, *refs):
        q_refs, (c_ref, o_ref, lse_ref) = refs[:n_parts], refs[n_parts:]
        pl.run_scoped(
            lambda *scoped: kernel(len_ref, q_refs, c_ref, o_ref, lse_ref, scoped),
            # The queries' staging buffer and the output's overlap the ring's slot 0: every member of a union starts
            # at its start (Mosaic GPU today), and both are smaller than a slot, so blocks copied into slots 1 and up
            # while the queries are staged do not touch them.
            plgpu.RefUnion(plgpu.SMEM((stages, block_kv, width), cache.dtype, transforms=transforms),
                           *staged_queries,
                           plgpu.SMEM((2, TILE_ROWS, r // 2), cache.dtype, transforms=transforms)),
            plgpu.SMEM((TILE_ROWS, width - r), cache.dtype, transforms=transforms),
            plgpu.SMEM((stages, TILE_ROWS), jnp.float32),
            (plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier()),
            *own_queries,
            collective_axes="wg",
        )

    return launch_over_tiles(entry, lengths, q_parts, cache, splits=splits, tiles=tiles, out_rows=out_rows,
                             latent_dim=r)
