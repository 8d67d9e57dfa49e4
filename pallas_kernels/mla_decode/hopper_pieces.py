"""What the Hopper MLA decode kernels (`hopper.py`, query rows on the MMAs' M side; `hopper_columns.py`, on their N
side) share: a split's range of cache blocks, the query rows' last visible slots and the online-softmax step of a
64-row tile, the values zeroed past a row's length, the memory warpgroup's ring of cache blocks, and the split of a
program into two compute warpgroups and one memory warpgroup, and their launch over (row, split, tile)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def split_blocks(len_ref, row, split, *, split_len: int, bkv: int, n_slots: int):
    """(the row's given length, that length clamped to the cache's `n_slots`, the split's first slot, the number of
    `bkv`-slot blocks the split covers up to the row's length)."""
    given_length = len_ref[row]
    length = jnp.minimum(given_length, n_slots)
    start = split * split_len
    stop = jnp.minimum(start + split_len, length)
    return given_length, length, start, jnp.maximum(0, (stop - start + bkv - 1) // bkv)


TILE_ROWS = 64            # query rows a program of the M-side kernels holds: the M side of one warpgroup MMA
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)


def query_limits(tile, given_length, *, heads: int, sq: int, n_slots: int, layout):
    """[64] int32 in the WGMMA row layout: the last slot each query row of the tile may see (row t * heads + h is query
    token t: it sees slots up to given_length - sq + t, clamped to the cache)."""
    q_rows = tile * TILE_ROWS + plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, 64), 0, layout=layout)
    last = jnp.minimum(given_length - sq + jnp.minimum(q_rows // heads, sq - 1), n_slots - 1)
    return last.max(axis=1)


def softmax_step(s, first_slot, limit, m, l, *, scale: float, dtype, layout):
    """One block's online-softmax step in the exp2 domain. s [64, bkv] fp32 scores (Q K^T) of the block whose first
    slot is `first_slot`, masked past each row's `limit`; m, l [64] the running maximum and row sum. Returns (bf16
    probabilities, the rescale factor exp2(m - m_new), m_new, the rescaled row sum plus the block's). The [64, bkv]
    mask is rebuilt per block (keeping it live across blocks would cost registers the accumulators need)."""
    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=layout)
    visible = first_slot + cols <= lax.broadcast_in_dim(limit, s.shape, [0])
    s = jnp.where(visible, s * (scale * LOG2E), NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    # A query row that has seen no visible slot yet (its last slot is before this split, or before slot 0) keeps
    # m = -huge: subtract 0 there so its masked scores give p = 0, not 1.
    shift = jnp.where(m_new > 0.5 * NEG, m_new, 0.0)
    p = jnp.exp2(s - lax.broadcast_in_dim(shift, s.shape, [0]))
    return p.astype(dtype), alpha, m_new, l * alpha + p.sum(axis=1)


def zero_value_tail(kv_smem, slot, base, length, columns, *, bkv: int, layout):
    """The `columns` of the cache block in `slot` (its first slot `base`) become 0 for slots at or past `length`
    (their probabilities are 0 already, but 0 * NaN is not 0)."""
    @pl.when(base + bkv > length)
    def _():
        v_ref = kv_smem.at[slot, :, columns]
        v = plgpu.load(v_ref, layout=layout)
        slots = base + plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=layout)
        v_ref[...] = jnp.where(slots < length, v, jnp.zeros_like(v))
        plgpu.commit_smem()


def stream_cache_blocks(c_ref, kv_smem, kv_bars, consumed, row, start, n_blocks, *, bkv: int, stages: int,
                        drain: bool):
    """The memory warpgroup's loop: block i of the split into ring slot i % stages (TMA, arriving on its barrier in
    `kv_bars`) once both compute warpgroups have released the block before it there (`consumed`). With `drain`, it
    then also waits for the last blocks' releases, so that it observes every phase of `consumed` (Mosaic GPU's
    interpret mode checks that)."""
    @pl.loop(0, n_blocks)
    def _load(i):
        slot = lax.rem(i, stages)

        @pl.when(i >= stages)
        def _():
            plgpu.barrier_wait(consumed.at[slot])

        plgpu.copy_gmem_to_smem(c_ref.at[row, pl.ds(start + i * bkv, bkv)], kv_smem.at[slot], kv_bars.at[slot])

    if drain:
        @pl.loop(jnp.maximum(n_blocks - stages, 0), n_blocks)
        def _drain(i):
            plgpu.barrier_wait(consumed.at[lax.rem(i, stages)])


def run_warpgroups(wg, compute, memory) -> None:
    """Warpgroups 0 and 1 run `compute(w)` with more registers, warpgroup 2 runs `memory()` with fewer."""
    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        for w in (0, 1):
            pl.when(wg == w)(functools.partial(compute, w))

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        memory()


def launch_over_tiles(entry, lengths, q_parts, cache, *, splits: int, tiles: int, out_rows: int, latent_dim: int,
                      reduction_bytes: int = 0, interpret: bool = False):
    """Launches `entry` (the kernel body over three warpgroups named "wg") on a grid (row, split, tile) and returns
    (o [B, splits, out_rows, R] in the cache dtype, lse [B, splits, out_rows] fp32). The last grid axis varies
    fastest in the launch order (Mosaic GPU maps it to blockIdx.x): the tiles of one (row, split) run side by side,
    so the later tiles' cache reads hit L2. `reduction_bytes`: scratch for reductions across warps (none when rows
    reduce within warps, as in the WGMMA layout)."""
    b = cache.shape[0]
    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((b, splits, out_rows, latent_dim), cache.dtype),
                  jax.ShapeDtypeStruct((b, splits, out_rows), jnp.float32)),
        grid=(b, splits, tiles),
        grid_names=("row", "split", "tile"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=reduction_bytes),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(lengths.astype(jnp.int32), *q_parts, cache)
