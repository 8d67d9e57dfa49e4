"""Absorbed MLA decode for Hopper, in Pallas Mosaic GPU (warpgroup MMA, TMA, warp specialisation).

One program per (row, sequence split, query tile). A query tile is 64 query rows (heads x query
tokens, row t * H + h), the M side of one warpgroup MMA, so every head of a tile shares one read of
the cache; rows past H x Sq are padding. The tiles of one (row, split) are launched next to each
other, so when there are several (H x Sq > 64) the later ones find the cache blocks in L2. Three
warpgroups:

* the memory warpgroup copies the tile's queries once and then the split's cache blocks
  ([block_kv, R + P] each) into a ring of `stages` shared-memory buffers (TMA, one barrier per
  buffer), reusing a buffer once both compute warpgroups have released it;
* compute warpgroup 0 scores the block (Q [64, R + P] @ K^T, fp32) and runs the online softmax in
  the exp2 domain; it hands the bf16 probabilities and the rescale factor to warpgroup 1 through
  one shared-memory buffer guarded by a ready / free barrier pair (`HopperMLABlocks.scoring` names
  the other arrangements: the two taking turns, or both scoring every block);
* each compute warpgroup accumulates P @ V for its half of the R output columns in registers
  ([64, R / 2] fp32: the whole [64, R] would not fit one warpgroup's registers).

A split covers whole blocks and stops at the row's length; in the block that holds the length,
the values of the slots past it are zeroed in shared memory before P @ V (their probabilities are
already 0, and a cache poisoned there must not reach the output). Splits write their normalised
output (bf16) and log-sum-exp (base 2); `combine_splits` merges them. `mla_decode_hopper_splits` is
the kernel alone: it takes query rows already laid out as it reads them (a caller's kernel can write
them so) and returns the splits unmerged (for a consumer kernel that merges them itself).

Runs on NVIDIA Hopper GPUs only (Mosaic GPU's interpret mode lacks `run_state`, the accumulator
update); its lowering for CUDA is checked on any host. `HopperMLABlocks(query_side="n")` launches the
transposed kernel of `hopper_columns.py` instead, which also runs in interpret mode. The twin is
`reference.mla_decode_reference`, and `kernel.mla_decode_pallas` is the Triton-lowered form.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla_decode.hopper_columns import column_smem_bytes, column_tile_rows, column_tiles, launch_columns
from pallas_kernels.mla_decode.hopper_pieces import (NEG, TILE_ROWS, launch_over_tiles, query_limits, run_warpgroups,
                                                    softmax_step, split_blocks, stream_cache_blocks, zero_value_tail)
from pallas_kernels.mla_decode.merge import MANY_SPLITS, merge_splits_pallas
from pallas_kernels.mla_decode.reference import validate_inputs

_SMEM_BYTES = 227 * 1024  # shared memory one H100/H200 block may take
_SMEM_OVERHEAD = 2048     # barriers and the alignment of swizzled buffers (measured: ~1.6 KB)


SCORINGS = ("alternate", "first", "each")
QUERY_SIDES = ("m", "n")
MERGES = ("auto", "xla", "pallas")
# "auto" merges this many splits or more in the one Pallas launch: the regime measured (H200, MLA merge sweep 2:
# 128 splits 2.9 us against XLA's 8.2; at 2 splits XLA's 3.5 beat the launch's best 4.3); the counts in between
# were not measured. The same bound picks the launch's own settings (`merge.merge_settings`).
PALLAS_MERGE_FROM_SPLITS = MANY_SPLITS


@dataclass(frozen=True)
class HopperMLABlocks:
    """Launch settings: cache slots per block, buffers in flight, splits along the sequence
    (0 = enough programs for one wave over `sms` multiprocessors), and who scores a block (Q K^T
    and the online softmax):

    * "first" (default): warpgroup 0 scores every block and hands the bf16 probabilities and the
      rescale factor to warpgroup 1 through shared memory;
    * "alternate": the two compute warpgroups take turns (even blocks warpgroup 0, odd ones 1), each
      handing its probabilities, rescale factor and running maximum to the other; a warpgroup issues
      the score MMA of its next block before it waits for the other's probabilities. Exact, but on
      the H200 it ran at half the speed of "first" (both warpgroups then hold a score tile beside
      their [64, 256] fp32 accumulator, and ptxas spills 1.3 KB per thread);
    * "each": both score every block themselves (twice the score MMAs, no hand-off).

    `query_buffers`: 2 = the tile's q_lat and q_pe in two shared-memory buffers, copied from where
    they are (no concatenation in XLA), scored by two MMAs; 1 = one [64, R + P] buffer and one score
    MMA, the queries laid out by XLA first (the form before; kept to compare the two in one run).

    `merge`: how `mla_decode_hopper` merges the splits: "xla" (`combine_splits` on the real rows, the
    reference: four XLA kernels, 8.2 us at 1 x 128K), "pallas" (`merge.merge_splits_pallas`, one launch:
    2.9 us there) or "auto" (the default: "pallas" from PALLAS_MERGE_FROM_SPLITS launched splits on, the
    long-cache, few-row regime where it measured faster, else "xla": at 2 splits, 64 x 4K, XLA's 3.5 us beat
    the launch's best 4.3; RESULTS.md, MLA merge sweep 2).

    `query_side`: "m" (default) puts a tile's 64 query rows on the M side of the MMAs (this file's kernel);
    "n" puts the cache block there and the query rows on the N side (`hopper_columns.py`: tiles of any
    multiple of 8 rows up to 64, so 96 heads are two tiles of 48 rows instead of two of 64, three quarters
    of the MMA work; only with scoring="first").

    `min_split_blocks`: the fewest cache blocks an automatic split covers. At one row and a short cache
    the kernel is latency, about 2.4 us per block in turn on one program: at B = 1 over 192 slots
    (3 blocks) 3 splits took 7.2 us against 12.0 us for one (`benchmarks/mla_decode_step.py`), so by
    default every block may get its own program when there are SMs to spare.
    """

    block_kv: int = 64
    stages: int = 2
    num_splits: int = 0
    scoring: str = "first"
    query_buffers: int = 2
    min_split_blocks: int = 1
    merge: str = "auto"
    query_side: str = "m"
    sms: int = 132

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"HopperMLABlocks: scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.query_buffers not in (1, 2):
            raise ValueError(f"HopperMLABlocks: query_buffers must be 1 or 2, got {self.query_buffers}")
        if self.merge not in MERGES:
            raise ValueError(f"HopperMLABlocks: merge must be one of {MERGES}, got {self.merge!r}")
        if self.query_side not in QUERY_SIDES:
            raise ValueError(f"HopperMLABlocks: query_side must be one of {QUERY_SIDES}, got {self.query_side!r}")
        if self.query_side == "n" and self.scoring != "first":
            raise ValueError(f"HopperMLABlocks: query_side='n' scores with scoring='first' only, got {self.scoring!r}")
        if self.min_split_blocks < 1:
            raise ValueError(f"HopperMLABlocks: min_split_blocks must be >= 1, got {self.min_split_blocks}")

    @property
    def shares_probabilities(self) -> bool:
        return self.scoring != "each"

    def splits_for(self, programs: int, slots: int) -> int:
        """Splits asked for (`split_layout` gives the count that runs)."""
        if self.num_splits:
            return self.num_splits
        return max(1, min(self.sms // max(1, programs), slots // (self.min_split_blocks * self.block_kv)))

    def split_layout(self, programs: int, slots: int) -> tuple[int, int]:
        """(splits launched, slots per split): splits cover whole blocks, so e.g. 132 asked over
        2,048 blocks launch 128 of 16 blocks each."""
        split_len = -(-(slots // self.block_kv) // self.splits_for(programs, slots)) * self.block_kv
        return -(-slots // split_len), split_len


def _kernel(len_ref, q_refs, c_ref, o_ref, lse_ref, scoped, *, heads, sq, r, bkv, stages, split_len, scale, scoring,
            n_slots, q_copy_rows):
    (q_or_out, kv_smem, p_smem, alpha_smem, m_smem), (q_bar, kv_bars, ready, p_free), consumed, done = scoped
    q_bufs, out_smem = q_or_out        # the query tile (one or two buffers), then (both done) the output
    tile, split, row = lax.axis_index("tile"), lax.axis_index("split"), lax.axis_index("row")
    wg = lax.axis_index("wg")
    given_length, length, start, n_blocks = split_blocks(len_ref, row, split, split_len=split_len, bkv=bkv,
                                                         n_slots=n_slots)
    half = r // 2
    layout = plgpu.Layout.WGMMA
    row_layout = layout.reduce(1)

    def issue_scores(s_ref, slot):
        if len(q_bufs) == 1:
            plgpu.wgmma(s_ref, q_bufs[0], kv_smem.at[slot].transpose((1, 0)))
        else:
            q_lat_smem, q_pe_smem = q_bufs
            plgpu.wgmma(s_ref, q_lat_smem, kv_smem.at[slot, :, pl.ds(0, r)].transpose((1, 0)))
            plgpu.wgmma(s_ref, q_pe_smem, kv_smem.at[slot, :, pl.ds(r, q_pe_smem.shape[1])].transpose((1, 0)))

    def softmax(s, i, limit, m, l):
        """Block i's online-softmax step (`hopper_pieces.softmax_step`)."""
        return softmax_step(s, start + i * bkv, limit, m, l, scale=scale, dtype=kv_smem.dtype, layout=layout)

    def zero_tail(slot, i, w):
        """Values of slots at or past the row's length become 0 in this warpgroup's half of the block."""
        zero_value_tail(kv_smem, slot, start + i * bkv, length, pl.ds(w * half, half), bkv=bkv, layout=layout)

    def add_values(acc, alpha, p, slot, w):
        """acc * alpha + P @ V over this warpgroup's half of the value columns (P in registers or
        shared memory); waits for every MMA this warpgroup has in flight."""
        def values(acc_ref):
            plgpu.wgmma(acc_ref, p, kv_smem.at[slot, :, pl.ds(w * half, half)])

        return pl.run_state(values)(plgpu.ACC.init(acc * lax.broadcast_in_dim(alpha, acc.shape, [0])))

    def publish(p, alpha, m, other):
        """Hands block probabilities, the rescale factor and (when `other` scores later blocks) the
        running maximum to `other`."""
        p_smem[...] = p
        alpha_smem[...] = alpha
        if scoring == "alternate":
            m_smem[...] = m
        plgpu.commit_smem()
        plgpu.barrier_arrive(ready.at[other])

    def receive(w, m):
        """(rescale factor, running maximum) of the block the other warpgroup scored."""
        plgpu.barrier_wait(ready.at[w])
        alpha = plgpu.load(alpha_smem, layout=row_layout)
        return alpha, (plgpu.load(m_smem, layout=row_layout) if scoring == "alternate" else m)

    def row_sums_meet(w, l):
        """Once both warpgroups are past their loops (every hand-off taken, no more reads of the query
        tile): each posts its row sum (warpgroup w in the hand-off buffer w) and reads the other's.
        With "each" both have the whole sum already: only the first meeting (the query tile free)."""
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
        if scoring == "each":
            return l
        (alpha_smem if w == 0 else m_smem)[...] = l
        plgpu.commit_smem()
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
        return plgpu.load(m_smem if w == 0 else alpha_smem, layout=row_layout)

    def finish(w, acc, m, l):
        """Normalise, write this warpgroup's half of the output and (warpgroup 0) the log-sum-exp
        (staged in the hand-off buffer 1, which warpgroup 1 no longer reads). `l` is the row sum
        both warpgroups agree on."""
        seen = l > 0
        inv = 1.0 / jnp.where(seen, l, 1.0)
        out_smem.at[w][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(out_smem.dtype)
        if w == 0:
            m_smem[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), NEG)
        plgpu.commit_smem()
        rows = pl.ds(tile * TILE_ROWS, TILE_ROWS)
        plgpu.copy_smem_to_gmem(out_smem.at[w], o_ref.at[row, split, rows, pl.ds(w * half, half)])
        if w == 0:
            plgpu.copy_smem_to_gmem(m_smem, lse_ref.at[row, split, rows])
        plgpu.wait_smem_to_gmem(0)

    def start_state():
        limit = query_limits(tile, given_length, heads=heads, sq=sq, n_slots=n_slots, layout=layout)
        m = plgpu.layout_cast(jnp.full((TILE_ROWS,), NEG, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.zeros((TILE_ROWS,), jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.zeros((TILE_ROWS, half), jnp.float32), layout)
        return limit, acc, m, l

    def compute_one_scorer(w):
        """"first" (warpgroup 0 scores every block) and "each" (both do)."""
        plgpu.barrier_wait(q_bar)
        shared = scoring == "first"
        scorer = w == 0 or not shared
        limit, acc, m, l = start_state()

        def step(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(kv_bars.at[slot])
            if scorer:
                def mma(s_ref):
                    issue_scores(s_ref, slot)
                    return s_ref[...]

                s = pl.run_scoped(mma, plgpu.ACC((TILE_ROWS, bkv), jnp.float32))
                p, alpha, m, l = softmax(s, i, limit, m, l)
                if shared:                       # hand the probabilities and the rescale to warpgroup 1
                    @pl.when(i > 0)
                    def _():
                        plgpu.barrier_wait(p_free)   # warpgroup 1 is done with the previous block's

                    publish(p, alpha, m, 1)
            else:
                alpha, m = receive(w, m)
                p = p_smem
            # With "each", warpgroup 0 may zero value columns of slots past the length while warpgroup 1's
            # score MMA still reads them as keys: only scores that are masked anyway can change.
            zero_tail(slot, i, w)
            acc = add_values(acc, alpha, p, slot, w)
            if not scorer:
                plgpu.barrier_arrive(p_free)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m, l

        acc, m, l = lax.fori_loop(0, n_blocks, step, (acc, m, l))
        other_l = row_sums_meet(w, l)
        if shared and w == 1:               # warpgroup 1 never scored: warpgroup 0's sum is the row's
            l = other_l
        finish(w, acc, m, l)

    def compute_alternating(w):
        """"alternate": warpgroup w scores blocks w, w + 2, ...; before scoring its next block it takes
        the other's previous one (probabilities from shared memory) into its half of the output."""
        plgpu.barrier_wait(q_bar)
        other = 1 - w
        limit, acc, m, l = start_state()

        def take_other(i, acc, m, l):
            """Block i, scored by the other warpgroup: rescale and add its P @ V for this half."""
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(kv_bars.at[slot])
            alpha, m = receive(w, m)
            zero_tail(slot, i, w)
            acc = add_values(acc, alpha, p_smem, slot, w)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m, l * alpha

        def own(k, carry, take_previous=True):
            """Block 2k + w: its score MMA is issued first and runs while this warpgroup waits for
            (and takes) the other's block 2k + w - 1; then its softmax, hand-off and P @ V."""
            acc, m, l = carry
            i = 2 * k + w
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(kv_bars.at[slot])

            def overlapped(s_ref):
                issue_scores(s_ref, slot)
                taken = take_other(i - 1, acc, m, l) if take_previous else (acc, m, l)
                return (s_ref[...], *taken)

            s, acc, m, l = pl.run_scoped(overlapped, plgpu.ACC((TILE_ROWS, bkv), jnp.float32))
            p, alpha, m, l = softmax(s, i, limit, m, l)
            publish(p, alpha, m, other)          # the other takes it before its next block (or at the end)
            zero_tail(slot, i, w)
            acc = add_values(acc, alpha, p, slot, w)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m, l

        count = (n_blocks - w + 1) // 2          # blocks w, w + 2, ... below n_blocks
        carry = (acc, m, l)
        if w == 0:                               # block 0 has no previous block to take
            carry = lax.fori_loop(0, jnp.minimum(count, 1), functools.partial(own, take_previous=False), carry)
            carry = lax.fori_loop(1, count, own, carry)
        else:
            carry = lax.fori_loop(0, count, own, carry)
        last_is_other = (n_blocks > 0) & (lax.rem(n_blocks, 2) == w)     # block n - 1 scored by the other
        acc, m, l = lax.fori_loop(0, last_is_other.astype(jnp.int32),
                                  lambda _, c: take_other(n_blocks - 1, *c), carry)
        finish(w, acc, m, l + row_sums_meet(w, l))

    compute = compute_alternating if scoring == "alternate" else compute_one_scorer

    def memory():
        # The tile's queries, from one laid-out array or two; rows past the last one are zeros (out of
        # bounds) or left as they are: padding either way.
        rows = pl.ds(tile * TILE_ROWS, q_copy_rows)
        if len(q_bufs) == 1:
            plgpu.copy_gmem_to_smem(q_refs[0].at[row, rows], q_bufs[0].at[pl.ds(0, q_copy_rows)], q_bar)
        else:
            pe = q_bufs[1].shape[1]
            if len(q_refs) == 1:
                srcs = q_refs[0].at[row, rows, pl.ds(0, r)], q_refs[0].at[row, rows, pl.ds(r, pe)]
            else:
                srcs = q_refs[0].at[row, rows], q_refs[1].at[row, rows]
            for src, buf in zip(srcs, q_bufs):
                plgpu.copy_gmem_to_smem(src, buf.at[pl.ds(0, q_copy_rows)], q_bar)

        stream_cache_blocks(c_ref, kv_smem, kv_bars, consumed, row, start, n_blocks, bkv=bkv, stages=stages,
                            drain=False)

    run_warpgroups(wg, compute, memory)


def smem_bytes(width: int, blocks: HopperMLABlocks) -> int:
    """Shared memory of one program: the query tile, the cache ring and one block's probabilities
    (bf16; not when each warpgroup scores for itself), two per-row statistics (fp32: the rescale
    factor and running maximum handed over; at the end the row sums and the log-sum-exp)."""
    p_cols = blocks.block_kv if blocks.shares_probabilities else 0
    return (2 * width * (TILE_ROWS + blocks.stages * blocks.block_kv) + 2 * TILE_ROWS * p_cols + 8 * TILE_ROWS
            + _SMEM_OVERHEAD)


def _refusal(shape, dtype, r: int, blocks: HopperMLABlocks, rows: int | None = None) -> str | None:
    """Why the kernel cannot take a cache of this [B, S, R + P] shape and dtype with latent width R and
    `rows` query rows a batch row (None: it can; rows=None: any count the "m" form takes)."""
    _, s, width = shape
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the cache must be bf16 or fp16, got {jnp.dtype(dtype)}"
    if s % blocks.block_kv or r % 128 or width % 64 or blocks.block_kv % 64:
        return (f"cache length {s} must be a multiple of block_kv={blocks.block_kv} (itself of 64); "
                f"R={r} a multiple of 128 and R + P={width} of 64")
    if blocks.scoring == "alternate" and blocks.stages < 2:
        return "scoring='alternate' needs stages >= 2 (a warpgroup scores block i before it takes block i - 1)"
    if blocks.query_side == "n" and rows is not None:
        need = column_smem_bytes(column_tile_rows(rows), width, blocks.block_kv, blocks.stages)
        if need > _SMEM_BYTES:
            return (f"query_side='n': {need} bytes of shared memory for tiles of {column_tile_rows(rows)} query rows, "
                    f"block_kv={blocks.block_kv}, stages={blocks.stages}; at most {_SMEM_BYTES} "
                    f"(fewer stages or a smaller block_kv fit)")
    elif smem_bytes(width, blocks) > _SMEM_BYTES:
        return (f"{smem_bytes(width, blocks)} bytes of shared memory for block_kv={blocks.block_kv}, "
                f"stages={blocks.stages}; at most {_SMEM_BYTES}")
    return None


def hopper_takes(cache_shape, cache_dtype, latent_dim: int, blocks: HopperMLABlocks = HopperMLABlocks()) -> bool:
    """Whether `mla_decode_hopper` runs this cache ([B, S, R + P] with R = latent_dim). For query_side="n" the
    shared memory is checked at the "m" form's budget (64-row tiles), which is at least the "n" form's."""
    return _refusal(cache_shape, cache_dtype, latent_dim, blocks) is None


def combine_splits(o, lse):
    """Merge per-split outputs. o [B, splits, rows, R] (normalised), lse [B, splits, rows] (base 2)
    -> [B, rows, R] fp32. Splits that saw nothing carry lse = NEG and weigh zero."""
    top = jnp.max(lse, axis=1, keepdims=True)
    w = jnp.exp2(lse - top)
    return jnp.sum(o.astype(jnp.float32) * w[..., None], axis=1) / jnp.sum(w, axis=1)[..., None]


def query_rows(heads: int, sq: int) -> int:
    """Query rows the kernel reads per batch row: heads x query tokens, up to whole tiles."""
    return -(-heads * sq // TILE_ROWS) * TILE_ROWS


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret"))
def mla_decode_hopper(q_lat, q_pe, cache, lengths, *, scale: float, blocks: HopperMLABlocks = HopperMLABlocks(),
                      interpret: bool = False):
    """Absorbed MLA attention over a latent cache on Hopper (`kernel.mla_decode_pallas`'s contract).

    Args:
      q_lat: [B, Sq, H, R] queries in the latent space. q_pe: [B, Sq, H, P] rope-part queries.
      cache: [B, S, R + P] bf16 or fp16, latents | k_pe per slot; S a multiple of block_kv.
      lengths: [B] int32 valid slots per row; query t of a row sees slots [0, lengths - Sq + t].
      scale: softmax scale. blocks: launch settings.
      interpret: Mosaic GPU's interpret mode (the CPU); query_side="n" only.
    Returns:
      [B, Sq, H, R] fp32.
    """
    validate_inputs(q_lat, q_pe, cache, lengths)
    b, sq, h, r = q_lat.shape
    rows = sq * h
    if interpret and blocks.query_side != "n":
        raise ValueError("mla_decode_hopper: interpret mode runs query_side='n' only (the 'm' form needs run_state)")
    if blocks.query_side == "n":
        tile_rows, tiles = column_tile_rows(rows), column_tiles(rows)
    else:
        tile_rows, tiles = TILE_ROWS, query_rows(h, sq) // TILE_ROWS
    if blocks.query_buffers == 2 and rows % 8 == 0:     # read where they are (TMA takes whole 8-row groups)
        parts = tuple(x.reshape(b, rows, x.shape[-1]).astype(cache.dtype) for x in (q_lat, q_pe))
        copy_rows = min(rows, tile_rows)
    else:                                    # not whole 8-row groups: lay them out, padded to whole tiles
        q = jnp.concatenate([q_lat, q_pe], axis=-1).reshape(b, rows, cache.shape[2]).astype(cache.dtype)
        parts, copy_rows = (jnp.pad(q, ((0, 0), (0, tiles * tile_rows - rows), (0, 0))),), tile_rows
    if blocks.query_side == "n":
        if (why := _refusal(cache.shape, cache.dtype, r, blocks, rows)) is not None:
            raise ValueError(f"mla_decode_hopper: {why}")
        splits, split_len = blocks.split_layout(b * tiles, cache.shape[1])
        o, lse = launch_columns(parts, cache, lengths, heads=h, sq=sq, latent_dim=r, scale=scale,
                                block_kv=blocks.block_kv, stages=blocks.stages, splits=splits, split_len=split_len,
                                out_rows=tiles * tile_rows, q_copy_rows=copy_rows, interpret=interpret)
    else:
        o, lse = _launch(parts, cache, lengths, heads=h, sq=sq, latent_dim=r, scale=scale, blocks=blocks,
                         out_rows=query_rows(h, sq), q_copy_rows=copy_rows)
    if o.shape[1] == 1:                      # one split: normalised already
        lat = o[:, 0, :rows].astype(jnp.float32)
    elif blocks.merge == "pallas" or (blocks.merge == "auto" and o.shape[1] >= PALLAS_MERGE_FROM_SPLITS):
        lat = merge_splits_pallas(o, lse, rows=rows, interpret=True if interpret else None)
    else:                                    # the real rows only: XLA then reads half the padded tile's bytes
        lat = combine_splits(o[:, :, :rows], lse[:, :, :rows])
    return lat.reshape(b, sq, h, r)


@functools.partial(jax.jit, static_argnames=("heads", "sq", "latent_dim", "scale", "blocks"))
def mla_decode_hopper_splits(q, cache, lengths, *, heads: int, sq: int, latent_dim: int, scale: float,
                             blocks: HopperMLABlocks = HopperMLABlocks()):
    """The kernel itself on queries already laid out as it reads them, returning the splits unmerged.

    Args:
      q: [B, rows, R + P] in the cache dtype: row t * heads + h is [q_lat | q_pe] of query token t,
        head h; rows >= query_rows(heads, sq) (rows past heads x sq are padding, any values).
      cache, lengths, scale, blocks: as `mla_decode_hopper`. latent_dim: R.
    Returns:
      (o [B, splits, rows, R] each split's normalised output in the cache dtype,
       lse [B, splits, rows] fp32 its base-2 log-sum-exp; -huge where the split saw no slot):
      `combine_splits` merges them. Rows past heads x sq are padding.
    """
    if blocks.query_side != "m":
        raise ValueError("mla_decode_hopper_splits: laid-out query rows are read in 64-row tiles (query_side='m'); "
                         f"got query_side={blocks.query_side!r}")
    b, s, width = cache.shape
    r = latent_dim
    n_rows = query_rows(heads, sq)
    if (q.ndim != 3 or q.shape[0] != b or q.shape[1] < n_rows or q.shape[2] != width or q.dtype != cache.dtype
            or lengths.shape != (b,)):
        raise ValueError(f"mla_decode_hopper: queries [{b}, >= {n_rows}, {width}] in {jnp.dtype(cache.dtype)} and "
                         f"lengths [{b}] needed for cache {cache.shape}; got {q.shape} {jnp.dtype(q.dtype)} and "
                         f"{lengths.shape}")
    return _launch((q,), cache, lengths, heads=heads, sq=sq, latent_dim=r, scale=scale, blocks=blocks,
                   out_rows=q.shape[1], q_copy_rows=TILE_ROWS)


def _launch(q_parts, cache, lengths, *, heads, sq, latent_dim, scale, blocks, out_rows, q_copy_rows):
    """The kernel launch. q_parts: (rows [B, >= whole tiles, R + P],) laid out, or (q_lat [B, Sq*H, R],
    q_pe [B, Sq*H, P]) copied side by side into each tile, `q_copy_rows` rows per copy (a whole tile,
    or all rows when there are fewer)."""
    b, s, width = cache.shape
    r = latent_dim
    if (why := _refusal(cache.shape, cache.dtype, r, blocks)) is not None:
        raise ValueError(f"mla_decode_hopper: {why}")
    bkv = blocks.block_kv
    tiles = query_rows(heads, sq) // TILE_ROWS
    splits, split_len = blocks.split_layout(b * tiles, s)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    stages = blocks.stages
    kernel = functools.partial(_kernel, heads=heads, sq=sq, r=r, bkv=bkv, stages=stages, split_len=split_len,
                               scale=scale, scoring=blocks.scoring, n_slots=s, q_copy_rows=q_copy_rows)
    n_parts = len(q_parts)

    def entry(len_ref, *refs):
        q_refs, (c_ref, o_ref, lse_ref) = refs[:n_parts], refs[n_parts:]
        pl.run_scoped(
            lambda *scoped: kernel(len_ref, q_refs, c_ref, o_ref, lse_ref, scoped),
            (plgpu.RefUnion(((plgpu.SMEM((TILE_ROWS, width), cache.dtype, transforms=transforms),)
                             if blocks.query_buffers == 1 else
                             (plgpu.SMEM((TILE_ROWS, r), cache.dtype, transforms=transforms),
                              plgpu.SMEM((TILE_ROWS, width - r), cache.dtype, transforms=transforms))),
                            plgpu.SMEM((2, TILE_ROWS, r // 2), cache.dtype, transforms=transforms)),
             plgpu.SMEM((stages, bkv, width), cache.dtype, transforms=transforms),
             (plgpu.SMEM((TILE_ROWS, bkv), cache.dtype, transforms=transforms) if blocks.shares_probabilities
              else plgpu.SMEM((8,), jnp.float32)),                   # unused when each warpgroup scores
             plgpu.SMEM((TILE_ROWS,), jnp.float32),                  # rescale factor handed over
             plgpu.SMEM((TILE_ROWS,), jnp.float32)),                 # running maximum handed over
            (plgpu.Barrier(num_arrivals=blocks.query_buffers), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=2),
             plgpu.Barrier()),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    return launch_over_tiles(entry, lengths, q_parts, cache, splits=splits, tiles=tiles, out_rows=out_rows,
                             latent_dim=r)
