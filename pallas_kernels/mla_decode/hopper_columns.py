"""Absorbed MLA decode for Hopper with the query rows on the N side of the warpgroup MMAs.

The kernel of `hopper.py` transposed. There a query tile is the M side of every MMA, and a warpgroup
MMA's M is 64: 96 heads take two 64-row tiles, 128 rows of MMA work for 96 real ones. Here the cache
block is the M side, and the queries are N, which may be any multiple of 8:

* warpgroup 0 scores a block as S^T = K Q^T ([block_kv, T] fp32 for a tile of T query rows) and runs the
  online softmax down the columns (the maximum and sum over a block's slots reduce across the
  warpgroup's four warps; `hopper.py` reduces along rows, within warps);
* it stores the bf16 probabilities transposed, as P [T, block_kv], to shared memory, with the
  rescale factor, and both compute warpgroups add O^T = V^T P^T for their half of the R value
  columns ([R / 2, T] fp32 in registers: 2T registers a thread, 128 at T = 64);
* the memory warpgroup copies the tile's queries once, then the split's cache blocks through a ring
  of `stages` buffers (as in `hopper.py`), and at the end waits for the last blocks' releases.

A tile holds `column_tile_rows(rows)` query rows: the rows spread evenly over as few tiles of at most 64
as hold them, rounded up to a multiple of 8 (96 heads: two tiles of 48; 32 heads: one of 32). The
splits, the zeroed values past a row's length and the outputs ([B, splits, tiles x T, R] normalised
bf16 and the base-2 log-sum-exp) are as in `hopper.py`, which launches this kernel for
`HopperMLABlocks(query_side="n")`.

Compiled, the value products accumulate through `pl.run_state` (the accumulator updated in place); in
Mosaic GPU's interpret mode, which lacks it, each block's products go to a fresh accumulator that is
added to the rescaled one (`accumulate="add"`, the same arithmetic in fp32), so this form also runs
on the CPU against the reference.

Measured on the H200 (RESULTS.md, run 31; B x ctx = 64 x 4K): at 96 heads the kernel took 189 us against
`hopper.py`'s 137 (2.96 against 2.14 us a 64-slot block a program, for 0.75x the MMA work), at 32 heads 77
against 80. So the work outside the MMAs (the column reductions, the transposed store of P, P read from shared
memory by both warpgroups) costs more than the padding rows it saves; "m" stays the default.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla_decode.hopper_pieces import (LOG2E, NEG, launch_over_tiles, run_warpgroups, split_blocks,
                                                    stream_cache_blocks, zero_value_tail)

MAX_TILE_ROWS = 64       # query rows a tile holds at most: 2T fp32 accumulator registers a thread
_REDUCTION_BYTES = 4 * 4 * MAX_TILE_ROWS     # cross-warp column reductions: 4 warps x T fp32


def column_tile_rows(rows: int) -> int:
    """Query rows per tile for `rows` query rows a batch row: as few tiles of at most 64 as hold them,
    the rows spread evenly, rounded up to a multiple of 8 (96 -> 48, 72 -> 40, 12 -> 16, 128 -> 64)."""
    tiles = -(-rows // MAX_TILE_ROWS)
    return -(-(-(-rows // tiles)) // 8) * 8


def column_tiles(rows: int) -> int:
    """Tiles a batch row's `rows` query rows take."""
    return -(-rows // column_tile_rows(rows))


def column_smem_bytes(tile_rows: int, width: int, block_kv: int, stages: int) -> int:
    """Shared memory of one program: the query tile (later the output and two per-column statistics), the
    cache ring, one block's probabilities (bf16), the rescale factor (fp32), the column reductions' scratch
    and barriers and alignment (measured at 64 rows: 231,488 bytes in all, this count's 231,680)."""
    return (2 * width * (tile_rows + stages * block_kv) + 2 * tile_rows * block_kv + 4 * tile_rows
            + _REDUCTION_BYTES + 1024)


def _kernel(len_ref, q_refs, c_ref, o_ref, lse_ref, scoped, *, heads, sq, r, t_rows, bkv, stages, split_len, scale,
            n_slots, q_copy_rows, accumulate):
    (q_or_out, kv_smem, p_smem, alpha_smem), (q_bar, kv_bars, ready, p_free), consumed, done = scoped
    # the query tile (one or two buffers), then (both warpgroups past their loops) the output and the column
    # statistics at the end (sums, log-sum-exp)
    q_bufs, (out_smem, l_smem, lse_smem) = q_or_out
    tile, split, row = lax.axis_index("tile"), lax.axis_index("split"), lax.axis_index("row")
    wg = lax.axis_index("wg")
    given_length, length, start, n_blocks = split_blocks(len_ref, row, split, split_len=split_len, bkv=bkv,
                                                         n_slots=n_slots)
    half = r // 2
    layout = plgpu.Layout.WGMMA
    col_layout = layout.reduce(0)

    def scores(slot):
        """S^T = K Q^T for the block in `slot`: [bkv, T] fp32."""
        def mma(s_ref):
            if len(q_bufs) == 1:
                plgpu.wgmma(s_ref, kv_smem.at[slot], q_bufs[0].transpose((1, 0)))
            else:
                q_lat_smem, q_pe_smem = q_bufs
                plgpu.wgmma(s_ref, kv_smem.at[slot, :, pl.ds(0, r)], q_lat_smem.transpose((1, 0)))
                plgpu.wgmma(s_ref, kv_smem.at[slot, :, pl.ds(r, q_pe_smem.shape[1])], q_pe_smem.transpose((1, 0)))
            return s_ref[...]

        return pl.run_scoped(mma, plgpu.ACC((bkv, t_rows), jnp.float32))

    def softmax(s, i, m, l):
        """Block i's scores masked (slot past a query row's last visible one: -huge) and the online-softmax
        step down each column (base 2). A query row's last visible slot is rebuilt per block."""
        q_rows = tile * t_rows + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=layout)
        last = jnp.minimum(given_length - sq + jnp.minimum(q_rows // heads, sq - 1), n_slots - 1)
        slots = start + i * bkv + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=layout)
        s = jnp.where(slots <= last, s * (scale * LOG2E), NEG)
        m_new = jnp.maximum(m, s.max(axis=0))
        alpha = jnp.exp2(m - m_new)
        # A query row that has seen no visible slot yet keeps m = -huge: subtract 0 there so that its masked
        # scores give p = 0, not 1.
        shift = jnp.where(m_new > 0.5 * NEG, m_new, 0.0)
        p = jnp.exp2(s - lax.broadcast_in_dim(shift, s.shape, [1]))
        return p.astype(kv_smem.dtype), alpha, m_new, l * alpha + p.sum(axis=0)

    def zero_tail(slot, i, w):
        """Values of slots at or past the row's length become 0 in this warpgroup's half of the block."""
        zero_value_tail(kv_smem, slot, start + i * bkv, length, pl.ds(w * half, half), bkv=bkv, layout=layout)

    def add_values(acc, alpha, slot, w):
        """acc * alpha + V^T P^T over this warpgroup's half of the value columns ([half, T]); P^T read from
        shared memory. Waits for the MMA."""
        v_t = kv_smem.at[slot, :, pl.ds(w * half, half)].transpose((1, 0))     # [half, bkv]
        p_t = p_smem.transpose((1, 0))                                         # [bkv, T]
        scaled = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
        if accumulate == "state":
            return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, v_t, p_t))(plgpu.ACC.init(scaled))

        def product(acc_ref):
            plgpu.wgmma(acc_ref, v_t, p_t)
            return acc_ref[...]

        return scaled + pl.run_scoped(product, plgpu.ACC((half, t_rows), jnp.float32))

    def finish(w, acc, m, l):
        """Normalise, store this warpgroup's half of the output transposed ([T, half]) and (warpgroup 0) the
        log-sum-exp, then copy them out. `l` is the column sum both warpgroups agree on."""
        seen = l > 0
        inv = 1.0 / jnp.where(seen, l, 1.0)
        o_t = (acc * lax.broadcast_in_dim(inv, acc.shape, [1])).astype(out_smem.dtype)
        out_smem.at[w].transpose((1, 0))[...] = o_t
        if w == 0:
            lse_smem[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), NEG)
        plgpu.commit_smem()
        rows = pl.ds(tile * t_rows, t_rows)
        plgpu.copy_smem_to_gmem(out_smem.at[w], o_ref.at[row, split, rows, pl.ds(w * half, half)])
        if w == 0:
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[row, split, rows])
        plgpu.wait_smem_to_gmem(0)

    def compute(w):
        plgpu.barrier_wait(q_bar)
        m = plgpu.layout_cast(jnp.full((t_rows,), NEG, jnp.float32), col_layout)
        l = plgpu.layout_cast(jnp.zeros((t_rows,), jnp.float32), col_layout)
        acc = plgpu.layout_cast(jnp.zeros((half, t_rows), jnp.float32), layout)

        def step(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(kv_bars.at[slot])
            if w == 0:
                p, alpha, m, l = softmax(scores(slot), i, m, l)

                @pl.when(i > 0)
                def _():
                    plgpu.barrier_wait(p_free)       # warpgroup 1 is done with the previous block's

                p_smem.transpose((1, 0))[...] = p   # P [T, bkv]: the value MMAs' B operand, K-major
                alpha_smem[...] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(ready)
            else:
                plgpu.barrier_wait(ready)
                alpha = plgpu.load(alpha_smem, layout=col_layout)
            zero_tail(slot, i, w)
            acc = add_values(acc, alpha, slot, w)
            if w == 1:
                plgpu.barrier_arrive(p_free)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m, l

        acc, m, l = lax.fori_loop(0, n_blocks, step, (acc, m, l))
        if w == 0:                               # observe warpgroup 1's last release (a barrier's every phase is seen)
            pl.when(n_blocks > 0)(lambda: plgpu.barrier_wait(p_free))
        # Only warpgroup 0 reads the query tile, and its score MMAs are done: it posts the column sums in the
        # tile's space, and once both warpgroups meet there, warpgroup 1 takes them and both write their output.
        if w == 0:
            l_smem[...] = l
            plgpu.commit_smem()
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
        if w == 1:
            l = plgpu.load(l_smem, layout=col_layout)
        finish(w, acc, m, l)

    def memory():
        rows = pl.ds(tile * t_rows, q_copy_rows)
        if len(q_bufs) == 1:
            plgpu.copy_gmem_to_smem(q_refs[0].at[row, rows], q_bufs[0].at[pl.ds(0, q_copy_rows)], q_bar)
        else:
            for src, buf in zip(q_refs, q_bufs):
                plgpu.copy_gmem_to_smem(src.at[row, rows], buf.at[pl.ds(0, q_copy_rows)], q_bar)
        stream_cache_blocks(c_ref, kv_smem, kv_bars, consumed, row, start, n_blocks, bkv=bkv, stages=stages,
                            drain=True)

    run_warpgroups(wg, compute, memory)


def launch_columns(q_parts, cache, lengths, *, heads: int, sq: int, latent_dim: int, scale: float, block_kv: int,
                   stages: int, splits: int, split_len: int, out_rows: int, q_copy_rows: int, interpret: bool = False):
    """The kernel launch over a grid (B, splits, tiles). q_parts: (rows [B, >= tiles x T, R + P],) laid out, or
    (q_lat [B, Sq*H, R], q_pe [B, Sq*H, P]) read in place, `q_copy_rows` rows a copy. Returns (o [B, splits,
    out_rows, R] in the cache dtype, lse [B, splits, out_rows] fp32), `hopper.combine_splits`'s inputs."""
    _, s, width = cache.shape
    r = latent_dim
    t_rows = column_tile_rows(heads * sq)
    tiles = column_tiles(heads * sq)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = functools.partial(_kernel, heads=heads, sq=sq, r=r, t_rows=t_rows, bkv=block_kv, stages=stages,
                               split_len=split_len, scale=scale, n_slots=s, q_copy_rows=q_copy_rows,
                               accumulate="add" if interpret else "state")
    n_parts = len(q_parts)
    q_shapes = ((t_rows, width),) if n_parts == 1 else ((t_rows, r), (t_rows, width - r))

    def entry(len_ref, *refs):
        q_refs, (c_ref, o_ref, lse_ref) = refs[:n_parts], refs[n_parts:]
        pl.run_scoped(
            lambda *scoped: kernel(len_ref, q_refs, c_ref, o_ref, lse_ref, scoped),
            (plgpu.RefUnion(tuple(plgpu.SMEM(shape, cache.dtype, transforms=transforms) for shape in q_shapes),
                            (plgpu.SMEM((2, t_rows, r // 2), cache.dtype, transforms=transforms),
                             plgpu.SMEM((t_rows,), jnp.float32), plgpu.SMEM((t_rows,), jnp.float32))),
             plgpu.SMEM((stages, block_kv, width), cache.dtype, transforms=transforms),
             plgpu.SMEM((t_rows, block_kv), cache.dtype, transforms=transforms),   # P, stored transposed
             plgpu.SMEM((t_rows,), jnp.float32)),                                  # rescale factor handed over
            (plgpu.Barrier(num_arrivals=n_parts), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(),
             plgpu.Barrier()),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    return launch_over_tiles(entry, lengths, q_parts, cache, splits=splits, tiles=tiles, out_rows=out_rows,
                             latent_dim=r, reduction_bytes=_REDUCTION_BYTES, interpret=interpret)
