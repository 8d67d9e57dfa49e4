"""Grouped matmul on packed MXFP4 weights for Hopper, in Pallas Mosaic GPU (warpgroup MMA, TMA).

The decode-sized case of the routed experts: few rows per expert, so the weights are the bytes to
move and the rows are few. The product is taken transposed ("swap AB"): a program holds 64 output
columns of one expert as the M side of a warpgroup MMA (the weights, decoded in registers) and its
tile of up to `rows` token rows as the N side (the activations, from shared memory):

    out[t, n] = sum_k x[t, k] W[k, n]   computed as   acc[n, t] = W^T[n, :] @ x^T[:, t]

Each step TMA-copies the packed codes of 64 columns x `block_k` inputs ([64, block_k/2] bytes, the
checkpoint's own out x in/2 orientation), their E8M0 scales ([block_k/32, 64]) and the tile's
activations into a ring of `stages` buffers. One scale group (32 inputs = 16 packed bytes per column)
at a time, the low nibbles (inputs 0, 2, ..) and the high nibbles (inputs 1, 3, ..) become two bf16
[64, 16] pieces, each times its group's power-of-two scale (exact). The activations arrive with each
group's 16 even inputs before its 16 odd ones (reordered once by XLA), so the pieces meet them in
order and the nibbles are never interleaved: no register moves between lanes. An MMA call takes one
piece, a group's two, or the whole step's (`HopperMxfp4Blocks.mma_inputs`).

Decodes (`HopperMxfp4Blocks.decode`, in `hopper_mxfp4_decode`):
* "exact": integer ops on each code, the magnitude built as an integer (0, 1, 2, 3, 4, 6, 8, 12 halves)
  and converted: runs everywhere, also in Mosaic GPU's interpret mode on the CPU;
* "ptx": nine PTX instructions per four codes (two byte tables read by `prmt`, the signs placed by
  `lop3`) on the registers the codes are loaded in; compiled only;
* "bits" (the compiled default of tiles past `ROWS_OUT_UP_TO` rows): the same values by placing each code's
  bits where a bf16 holds them (its value times 2^-126) and one exact multiply by 2^126: five instructions per
  four codes on the integer ALU instead of eight (two integer multiplies and two bf16 multiplies go to the
  multiply-add pipe); compiled only. On the H200 (run 31) 3%, 9% and 6% faster than "ptx" at 1, 8 and 64 tokens.
* "scaled" (the compiled default of decode tiles): "bits" with the group's scale folded into its multiply (by
  2^126 x scale, one bf16 multiply per pair where "bits" and the scale take two): exact for E8M0 scale bytes up to
  128 (scales up to 2; larger ones come out inf or NaN, loudly, and a load into the column layouts refuses
  them); compiled only.
A operand (`HopperMxfp4Blocks.a_operand`): "registers" feeds the decoded weights to the MMA from
registers; "smem" stores them to shared memory first (the form Mosaic GPU's interpret mode runs).

A program reads its tile's activation rows from a slab XLA gathers for it, or in place from the sorted
rows through a window that starts on a whole 8-row tile (`HopperMxfp4Blocks.activations`). The programs
write fp32 products per tile ([splits, tiles, N, rows], or the window's rows: with
`HopperMxfp4Blocks.splits`, programs that share a tile's K steps write their parts apart); XLA adds the
parts, gathers each row from its tile (or, with `HopperMxfp4Blocks.outputs="rows"`, each program has written
its own rows' products into their rows) and applies the gated activation for the GLU. Rows sorted by
expert (`grouped_*`) are cut into tiles by `schedule.tile_schedule`; unsorted token-expert pairs (`pair_*`,
a few tokens: no sort) get one tile each (the pair's activations the first row of its slab, or its token's
row in its window). Tiles hold 8 rows at decode and up to 64 as the rows per expert grow
(`HopperMxfp4Blocks.for_backend`); in prefill every tile of an expert streams and decodes its weights
again, so this kernel is for decode first. It runs on Hopper GPUs (and in interpret mode off the GPU:
`runs_here`). Twin: `reference.grouped_matmul_reference` on the dequantised weights
(`mxfp4.dequantize`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._util import default_interpret
from pallas_kernels.moe_gmm.activation import GluSpec, glu
from pallas_kernels.moe_gmm.hopper_mxfp4_persistent import launch_persistent, persistent_takes
from pallas_kernels.moe_gmm.hopper_mxfp4_persistent import smem_bytes as persistent_smem_bytes
from pallas_kernels.moe_gmm.hopper_mxfp4_step import (ALIGN, CODE_TRANSFORMS, COLUMNS, PER_GROUP, X_TRANSFORMS,
                                                      copy_out_rows, launch_name, multiply_step, write_glu_slab)
from pallas_kernels.moe_gmm.mxfp4 import GROUP, Mxfp4Weight
from pallas_kernels.moe_gmm.mxfp4 import validate as validate_mxfp4
from pallas_kernels.moe_gmm.schedule import tile_schedule

_SMEM_BYTES = 227 * 1024          # shared memory one H100 / H200 block may take
_SMEM_OVERHEAD = 2048             # barriers and the alignment of swizzled buffers
_SMS = 132                        # multiprocessors of an H100 / H200 (SXM)
_SPLIT_TARGET = 2                 # programs per multiprocessor that `splits=0` reaches for
DECODES = ("exact", "ptx", "bits", "scaled")
A_OPERANDS = ("registers", "smem")
ACTIVATIONS = ("slab", "rows")
OUTPUTS = ("tiles", "rows")
LAUNCHES = ("grid", "persistent")
CODE_LOADS = ("pairs", "words")
# Decode tiles (at most this many rows) write their own rows out (`outputs="rows"`): Kimi-Linear's experts
# (benchmarks/RESULTS.md, run 33), 0.414 / 0.135 ms a call at 64 / 8 tokens against 0.424 / 0.145 with "tiles" on an
# H100, 0.414 / 0.129 against 0.413 / 0.134 on an H200.
# Larger tiles keep "tiles": untimed, and "rows" doubles the staged products' shared memory. At 1 token (H100, run
# 34) "tiles" took 1.20x the time of "rows" for Kimi-Linear and 1.08x at K3's latent widths (1/8 of the experts);
# at 8 tokens the two were level for both.
ROWS_OUT_UP_TO = 8
# Compiled decode tiles (at most ROWS_OUT_UP_TO rows) take one MMA call a step (`mma_inputs=0`). Nsight Compute at 64
# tokens of Kimi-Linear (H100, run 38): both launches issue-bound (74% / 82% of issue slots) at about 18 instructions
# per four codes, of which the per-16-input calls' B descriptor arithmetic and fences take about 4. One call a step
# computes the descriptor once and advances it by a constant: the two launches 326.0 against 346.8 us, the call
# 0.4153 against 0.4397 ms at 64 tokens (a second run: 0.4197 / 0.4177), 0.3087 / 0.3277 at 32, 0.4648 / 0.4899 at
# 128. The pairs (1-8 tokens) take it too: on an H100 (run 30) one call a step with the automatic split was 4%
# faster than a call per 16 inputs at 1 and 8 tokens. Larger tiles keep 16 (untimed with 0; their accumulators take
# more registers).
# Compiled decode tiles also take the "scaled" decode (the group's scale folded into the bits decode's multiply: 128
# fewer instructions a step of 1087). On an H200 at 64 tokens (run 41) it cut the two launches from 304 to 293 us and
# the call with the GLU hand-off to 0.3230-0.3445 ms (median of five 0.3276, 59.8% of 4.3 TB/s, unrolled) from
# 0.3392-0.3498; on an H100 (runs 38-40), where the launches sit near that card's memory, it was level. It is exact
# for E8M0 scale bytes up to SCALED_MAX_SCALE (scales up to 2, weights up to 12): a load into the column layouts
# refuses packed experts past that, and `decode="bits"` takes any scale.


class Mxfp4Columns(NamedTuple):
    """MXFP4 expert weights W [G, K, N] (used as x @ W[g]) stored column-major for this kernel:
      packed uint8 [G, N, K/2]: column n's inputs 2j (low nibble) and 2j + 1 (high nibble) in byte j,
                                as the checkpoint stores each expert (`weight_packed` [out, in/2]);
      scale  uint8 [G, K/32, N]: E8M0 per 32 inputs, as `mxfp4.Mxfp4Weight.scale`."""

    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical [G, K, N]."""
        g, n, half = self.packed.shape
        return g, 2 * half, n

    @property
    def ndim(self) -> int:
        return 3


class HandOffColumns(Mxfp4Columns):
    """`Mxfp4Columns` whose output columns are in `even_odd` order (`hopper_mxfp4_mlp.hand_off_columns`): the
    gate and up weights of `grouped_mlp_hopper_mxfp4(hand_off="glu")` and `routed_mlp_hopper_mxfp4`, which every
    other entry point refuses."""

    __slots__ = ()


class WordHandOffColumns(HandOffColumns):
    """`HandOffColumns` in `word_order` instead (`hand_off_columns(.., code_load="words")`): for a down launch that
    loads its codes a word at a time."""

    __slots__ = ()


def to_columns(w: Mxfp4Weight) -> Mxfp4Columns:
    """`mxfp4.Mxfp4Weight` ([G, K/2, N] codes) -> the column-major codes this kernel streams."""
    validate_mxfp4(w)
    return Mxfp4Columns(jnp.swapaxes(w.packed, 1, 2), w.scale)


def to_rows(w: Mxfp4Columns) -> Mxfp4Weight:
    """The inverse of `to_columns`: the [G, K/2, N] codes the other kernels and `mxfp4.dequantize` take."""
    return Mxfp4Weight(jnp.swapaxes(_validated(w).packed, 1, 2), w.scale)


def hopper_takes(k_dim: int, n_dim: int) -> bool:
    """Whether the kernel runs a [K, N] weight: K a multiple of 128 (whole pipeline steps) and N of 64."""
    return k_dim % 128 == 0 and n_dim % COLUMNS == 0


def runs_here(k_dim: int, n_dim: int) -> bool:
    """Whether this backend runs the kernel on a [K, N] weight: the sides fit (`hopper_takes`), and the
    GPU is a Hopper (warpgroup MMA and TMA; compute capability 9.x), or there is no GPU (interpret mode)."""
    if not hopper_takes(k_dim, n_dim):
        return False
    if jax.default_backend() != "gpu":
        return True
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def from_checkpoint_columns(packed_gnk, scale_gnk) -> Mxfp4Columns:
    """Stacked checkpoint tensors (packed [G, N, K/2], scale [G, N, K/32]) -> Mxfp4Columns: the codes
    keep their stored orientation; only the small scale array is transposed."""
    return _validated(Mxfp4Columns(packed_gnk, jnp.swapaxes(scale_gnk, 1, 2)))


def _validated(w: Mxfp4Columns) -> Mxfp4Columns:
    g, k, n = w.shape
    if w.packed.dtype != jnp.uint8 or w.scale.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 columns: packed and scale must be uint8, got {w.packed.dtype} and {w.scale.dtype}")
    if w.packed.ndim != 3 or k % GROUP or w.scale.shape != (g, k // GROUP, n):
        raise ValueError(f"MXFP4 columns: packed [G, N, K/2] with K a multiple of {GROUP} and scale [G, K/32, N]; "
                         f"got {w.packed.shape} and {w.scale.shape}")
    return w


@dataclass(frozen=True)
class HopperMxfp4Blocks:
    """Launch settings: token rows per tile (the MMA's N side: a multiple of 8, at most 256), inputs
    per pipeline step (`block_k`, a multiple of 128 dividing K), buffers in flight, the decode and
    where the MMA reads the decoded weights from (module docstring), `mma_inputs`: the inputs one MMA call
    takes (16: the low or the high nibbles of a scale group, 32: both, 0: the whole step; one fence and
    commit a call), and `splits`: programs that share
    one tile's K steps (their fp32 partial sums added by XLA; a divisor of K / block_k), 0 = the
    fewest that give `_SPLIT_TARGET` programs a multiprocessor (`splits_for`). `activations`: where a
    program of sorted rows reads its tile's rows from: "slab", a copy XLA gathers before the launch (each
    tile's rows padded to `rows`), or "rows", the sorted activations themselves through a window of
    `rows + 8` rows starting at the tile's first row rounded down to a multiple of 8 (the copies into
    tiled shared memory start on whole 8-row tiles; the window's extra rows cost MMA columns, not a
    gather). Unsorted pairs likewise: a slab, or the window around their token's row. `outputs`: "tiles",
    each program copies its [64, window] block of fp32 products out and XLA gathers every row's products from
    its tile's block; or "rows", each program transposes its block in shared memory and copies out only its
    own rows' products, straight into their rows of [M, N] (at most one copy per power of two up to `rows`),
    so XLA gathers nothing. `launch`: "grid", a program per tile, 64-column block and split, or "persistent",
    one warp-specialized program per multiprocessor (or `programs` of them) walking its share of tiles x
    128-column blocks in one pipeline (`hopper_mxfp4_persistent`; sorted rows in slabs, no splits, N a
    multiple of 128, compiled only; pairs keep the grid launch). `code_load`: "pairs", each thread loads its codes
    two bytes at a time in the WGMMA layout and decodes four codes at a time; or "words", four bytes at a time
    (Mosaic GPU's WGMMA_8BIT layout) decoded eight at a time with no `prmt` (`hopper_mxfp4_decode.decode_words`),
    the activations then in `word_order`. `for_backend` picks what runs; `smem_bytes` must stay within one
    block's shared memory."""

    rows: int = 8
    block_k: int = 256
    stages: int = 3
    decode: str = "bits"
    a_operand: str = "registers"
    splits: int = 1
    mma_inputs: int = 16
    activations: str = "slab"
    outputs: str = "tiles"
    launch: str = "grid"
    programs: int = 0
    code_load: str = "pairs"

    def __post_init__(self):
        if self.rows % 8 or not 8 <= self.rows <= 256:
            raise ValueError(f"HopperMxfp4Blocks: rows must be a multiple of 8 in [8, 256], got {self.rows}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"HopperMxfp4Blocks: activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        if self.outputs not in OUTPUTS:
            raise ValueError(f"HopperMxfp4Blocks: outputs must be one of {OUTPUTS}, got {self.outputs!r}")
        if self.launch not in LAUNCHES:
            raise ValueError(f"HopperMxfp4Blocks: launch must be one of {LAUNCHES}, got {self.launch!r}")
        if self.code_load not in CODE_LOADS:
            raise ValueError(f"HopperMxfp4Blocks: code_load must be one of {CODE_LOADS}, got {self.code_load!r}")
        if self.code_load == "words" and self.decode == "ptx":
            raise ValueError("HopperMxfp4Blocks: code_load='words' decodes with the bit placing of 'bits' or "
                             "'scaled' (or 'exact' in interpret mode), not decode='ptx'")
        if self.programs < 0:
            raise ValueError(f"HopperMxfp4Blocks: programs must be >= 0 (0: one a multiprocessor), got {self.programs}")
        if self.launch == "persistent" and (self.activations != "slab" or self.splits != 1):
            raise ValueError(f"HopperMxfp4Blocks: launch='persistent' takes activations='slab' and splits=1, got "
                             f"activations={self.activations!r}, splits={self.splits}")
        if self.window > 256:
            raise ValueError(f"HopperMxfp4Blocks: activations='rows' reads rows + {ALIGN} rows a tile, at most 256; "
                             f"got rows={self.rows}")
        if self.block_k % 128 or self.block_k <= 0:
            raise ValueError(f"HopperMxfp4Blocks: block_k must be a positive multiple of 128, got {self.block_k}")
        if self.stages < 1:
            raise ValueError(f"HopperMxfp4Blocks: stages must be >= 1, got {self.stages}")
        if self.decode not in DECODES:
            raise ValueError(f"HopperMxfp4Blocks: decode must be one of {DECODES}, got {self.decode!r}")
        if self.a_operand not in A_OPERANDS:
            raise ValueError(f"HopperMxfp4Blocks: a_operand must be one of {A_OPERANDS}, got {self.a_operand!r}")
        if self.splits < 0:
            raise ValueError(f"HopperMxfp4Blocks: splits must be >= 0 (0: auto), got {self.splits}")
        if self.mma_inputs not in (0, 16, 32):
            raise ValueError(f"HopperMxfp4Blocks: mma_inputs must be 16, 32 or 0 (the whole step), got "
                             f"{self.mma_inputs}")

    @property
    def inputs_per_mma(self) -> int:
        return self.mma_inputs or self.block_k

    @property
    def window(self) -> int:
        """Activation rows a program of sorted rows reads (the MMA's N): `rows`, or `rows + 8` from the
        sorted activations themselves (`activations="rows"`)."""
        return self.rows + (ALIGN if self.activations == "rows" else 0)

    def splits_for(self, programs: int, steps: int) -> int:
        """K splits for `programs` (tiles x column blocks) over `steps` pipeline steps: the setting, or for
        0 the smallest divisor of `steps` giving at least `_SPLIT_TARGET` programs per multiprocessor
        (decode: few tiles, one program a multiprocessor cannot keep enough bytes in flight). `programs`
        counts the launch's tiles, for sorted rows the schedule's bound with its empty tiles too."""
        if self.splits:
            return self.splits
        return next(d for d in range(1, steps + 1) if steps % d == 0 and (programs * d >= _SPLIT_TARGET * _SMS
                                                                          or d == steps))

    def smem_bytes(self, n_weights: int) -> int:
        """Shared memory of one program with `n_weights` weights: per buffer in flight the tile's
        activations (bf16) and each weight's codes and scales; the fp32 products staged for their copy out;
        with `a_operand="smem"` the decoded operand's buffer; with `outputs="rows"` the products transposed;
        barriers and alignment. The persistent launch: `hopper_mxfp4_persistent.smem_bytes`."""
        if self.launch == "persistent":
            return persistent_smem_bytes(self.rows, self.block_k, self.stages, n_weights, self.outputs,
                                         self.a_operand, self.inputs_per_mma)
        per_stage = self.window * self.block_k * 2 + n_weights * COLUMNS * (self.block_k // 2 + self.block_k // GROUP)
        operand = COLUMNS * self.inputs_per_mma * 2 if self.a_operand == "smem" else 0
        staged = n_weights * COLUMNS * self.window * 4 * (2 if self.outputs == "rows" else 1)
        return self.stages * per_stage + staged + operand + _SMEM_OVERHEAD

    @classmethod
    def for_backend(cls, interpreted: bool, k_dim: int | None = None, rows_per_group: float = 1.0,
                    n_weights: int = 2, **fields) -> "HopperMxfp4Blocks":
        """The compiled defaults, or in interpret mode (the CPU) the forms it runs: the exact decode
        and the operand through shared memory. With `k_dim`, the deepest default step that divides it.
        Tiles take up to 64 rows as `rows_per_group` grows (prefill: fewer re-reads of each expert's
        weights), with fewer buffers in flight where shared memory would not hold them; decode tiles (at most
        `ROWS_OUT_UP_TO` rows) write their own rows out (`outputs="rows"`) and, compiled, take one MMA call a
        step (`mma_inputs=0`) and the "scaled" decode (E8M0 scale bytes up to SCALED_MAX_SCALE)."""
        if interpreted:
            fields = {"decode": "exact", "a_operand": "smem", **fields}
        if k_dim is not None and "block_k" not in fields and k_dim % cls.block_k:
            fields["block_k"] = 128
        if "rows" not in fields:
            fields["rows"] = min(64, max(8, -(-int(np.ceil(rows_per_group)) // 8) * 8))
        if "outputs" not in fields and fields["rows"] <= ROWS_OUT_UP_TO:
            fields["outputs"] = "rows"
        if "mma_inputs" not in fields and not interpreted and fields["rows"] <= ROWS_OUT_UP_TO:
            fields["mma_inputs"] = 0            # one MMA call a step: fewer instructions for an issue-bound kernel
        if "decode" not in fields and not interpreted and fields["rows"] <= ROWS_OUT_UP_TO:
            fields["decode"] = "scaled"         # the scale in the decode's multiply (SCALED_MAX_SCALE)
        blocks = cls(**fields)
        while blocks.smem_bytes(n_weights) > _SMEM_BYTES and blocks.stages > 2 and "stages" not in fields:
            blocks = dataclasses.replace(blocks, stages=blocks.stages - 1)
        return blocks


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------

def _kernel(sched_ref, x_ref, *refs, n_weights, steps, window: int, in_place: bool, blocks: HopperMxfp4Blocks,
            glu_spec: GluSpec | None = None):
    """x_ref: activations in `k_order` (each scale group's 32 inputs as its 16 even then its 16 odd ones,
    `even_odd`, or `word_order`): a slab per tile [tiles, window, K], or (`in_place`) the rows themselves [M', K], each
    tile reading `window` rows from its first row rounded down to a multiple of `ALIGN`;
    refs: per weight packed [G, N, K/2] and scale [G, K/32, N]; out fp32 [weights, splits, tiles, N, window],
    or with `outputs="rows"` [splits, rows out, weights, N], or with `glu_spec` (gate and up, one split) h's bf16
    slabs [tiles, window, N]; scratch: the products' staging buffer (with `glu_spec`: h's, [window, 64] bf16),
    their transposed copy (`outputs="rows"`) and the decoded operand buffer. sched_ref [4, tiles]: each tile's
    group, its first and end row in x's rows (sorted rows; for pairs the token's row, end = first + valid) and
    the output row of its first row.
    `steps`: the pipeline steps of one split (its K range starts at split x steps x block_k)."""
    w_refs, (out_ref, o_smem, *scratch) = refs[:2 * n_weights], refs[2 * n_weights:]
    t_smem = scratch.pop(0) if blocks.outputs == "rows" and glu_spec is None else None   # glu: o_smem holds h
    a_smem = scratch
    tile, col, split = lax.axis_index("tile"), lax.axis_index("col"), lax.axis_index("split")
    first_step = split * steps
    group, first, last, out_first = (sched_ref[i, tile] for i in range(4))
    half, groups = blocks.block_k // 2, blocks.block_k // GROUP

    if in_place:    # the copies into tiled shared memory start on whole 8-row tiles: the window starts on one
        x_rows = x_ref.at[pl.ds(pl.multiple_of(first // ALIGN * ALIGN, ALIGN), window)]
    else:
        x_rows = x_ref.at[tile]

    def products(acc_refs):
        def step(idx, x_smem, *w_smem):
            multiply_step(x_smem, w_smem, acc_refs, block_k=blocks.block_k, decode=blocks.decode,
                          mma_inputs=blocks.inputs_per_mma, a_smem=a_smem[0] if a_smem else None,
                          code_load=blocks.code_load)

        x_spec = plgpu.BlockSpec((window, blocks.block_k), lambda kk: (0, first_step + kk),
                                 transforms=X_TRANSFORMS)
        w_specs = (plgpu.BlockSpec((COLUMNS, half), lambda kk: (col, first_step + kk), transforms=CODE_TRANSFORMS),
                   plgpu.BlockSpec((groups, COLUMNS), lambda kk: (first_step + kk, col)))
        plgpu.emit_pipeline(step, grid=(steps,), in_specs=[x_spec, *(w_specs * n_weights)],
                            max_concurrent_steps=blocks.stages)(x_rows, *(w.at[group] for w in w_refs))
        return tuple(acc[...] for acc in acc_refs)

    @pl.when(first < last)
    def _():
        accs = pl.run_scoped(lambda *accs: products(accs),
                             *(plgpu.ACC((COLUMNS, window), jnp.float32) for _ in range(n_weights)))
        if glu_spec is not None:
            write_glu_slab(*accs, o_smem, out_ref.at[tile, :, pl.ds(col * COLUMNS, COLUMNS)], glu_spec)
            plgpu.wait_smem_to_gmem(0)
            return
        for w, acc in enumerate(accs):
            o_smem.at[w][...] = acc
        plgpu.commit_smem()
        if blocks.outputs == "rows":
            copy_out_rows(o_smem, t_smem, out_ref.at[split], first % ALIGN if in_place else 0, last - first,
                           out_first, col, window, blocks.rows)
        else:
            for w in range(n_weights):
                plgpu.copy_smem_to_gmem(o_smem.at[w], out_ref.at[w, split, tile, pl.ds(col * COLUMNS, COLUMNS)])
        plgpu.wait_smem_to_gmem(0)


def even_odd(x):
    """[..., K] -> [..., K] with each scale group's 32 inputs reordered as its 16 even then its 16 odd ones,
    the order of the decoded pieces (low nibbles = even inputs, high nibbles = odd ones)."""
    *lead, k = x.shape
    return x.reshape(*lead, k // GROUP, PER_GROUP, 2).swapaxes(-1, -2).reshape(*lead, k)


def word_order(x):
    """[..., K] -> [..., K] in the order of `code_load="words"`'s pieces: `even_odd`, then each half of a group
    (its 16 even inputs, its 16 odd ones) by `hopper_mxfp4_decode.WORD_BYTES`: the inputs of the group's even
    bytes, then of its odd bytes."""
    *lead, k = x.shape
    # Input 4b + 2p + n of a group (byte 2b + p, nibble n) goes to slot 16n + 8p + b: one transpose of the group
    # as [b, p, n] (no gather by WORD_BYTES, which XLA ran as a second kernel of its own).
    groups = x.reshape(*lead, k // GROUP, PER_GROUP // 2, 2, 2)
    return groups.swapaxes(-1, -3).reshape(*lead, k)


def k_order(x, blocks: HopperMxfp4Blocks):
    """The activations [..., K] in the order `blocks`' decoded pieces take them (`even_odd` or `word_order`)."""
    return word_order(x) if blocks.code_load == "words" else even_odd(x)


def hand_off_order(n: int, code_load: str = "pairs") -> np.ndarray:
    """[n] int: column j of a hand-off weight for a down launch with `code_load` (or of the h its gated launch
    writes) is natural column order[j]: `k_order` of the columns."""
    return np.asarray(k_order(np.arange(n), HopperMxfp4Blocks(code_load=code_load)))


def _code_load(w: HandOffColumns) -> str:
    return "words" if isinstance(w, WordHandOffColumns) else "pairs"


def natural_order(h, w: HandOffColumns):
    """h [..., N] whose columns follow `w`'s hand-off order -> the natural order (the inverse permutation)."""
    return h[..., np.argsort(hand_off_order(h.shape[-1], _code_load(w)))]


def natural_columns(w: Mxfp4Columns) -> Mxfp4Columns:
    """A hand-off weight (`HandOffColumns`) with its columns put back in order, as a plain `Mxfp4Columns` (the
    weight itself otherwise)."""
    if not isinstance(w, HandOffColumns):
        return w
    inverse = np.argsort(hand_off_order(w.shape[2], _code_load(w)))
    return Mxfp4Columns(w.packed[:, inverse], w.scale[:, :, inverse])


def launch(sched, x, weights, rows_out: int, blocks: HopperMxfp4Blocks, interpret: bool, sorted_rows: bool,
           glu_spec: GluSpec | None = None):
    """The kernel over `sched` [4, T] (group, first, end row per tile, first >= end: nothing to do; the
    output row of its first row) with the activations in `k_order(.., blocks)`, bf16: each tile's own slab `x`
    [T, rows, K], or the sorted rows `x` [M', K] read in place (`_in_place_rows`: M' >= the largest first row
    rounded down to 8, plus `blocks.window`, and a multiple of 8) -> fp32 products: per tile
    [weights, T, N, rows] (slabs) or [weights, T, N, window] (column c: the product of row first // 8 * 8 + c);
    with `blocks.outputs="rows"` per row, [weights, rows_out, N] (rows no tile covers: not written).
    `sorted_rows`: the tiles are the schedule of sorted rows (live tiles first), which the persistent launch
    (`blocks.launch`) needs; pairs run the grid launch. `glu_spec` (weights gate and up, slabs in, sorted rows;
    the grid launch in one split, or the persistent one): each program applies the GLU to its products and
    writes them in bf16 as h's slabs [T, rows, N] (`hopper_mxfp4_step.write_glu_slab`; rows past a tile's last
    are act(0, 0) = 0; tiles with nothing to do are not written)."""
    if glu_spec is not None:
        if len(weights) != 2 or x.ndim != 3 or not sorted_rows:
            raise ValueError(f"hopper MXFP4: the GLU epilogue takes gate and up weights and sorted rows in slabs; "
                             f"got {len(weights)} weights, activations {x.shape}, sorted_rows={sorted_rows}")
    if blocks.launch == "persistent" and sorted_rows:
        partial = launch_persistent(sched, x, weights, rows_out, blocks, interpret,
                                    blocks.programs or _multiprocessors(), glu_spec)
    else:
        partial = _launch_grid(sched, x, weights, rows_out, blocks, interpret, glu_spec)
    if glu_spec is not None:                                   # h's slabs, whole
        return partial
    if blocks.outputs == "rows":
        return jnp.moveaxis(jnp.sum(partial, axis=0), 1, 0)
    return jnp.sum(partial, axis=1)


def _launch_grid(sched, x, weights, rows_out: int, blocks: HopperMxfp4Blocks, interpret: bool,
                 glu_spec: GluSpec | None = None):
    """A program per tile, 64-column block and split -> `launch`'s fp32 parts before the splits are added:
    [splits, rows_out, weights, N] (`outputs="rows"`) or [weights, splits, T, N, window]; with `glu_spec`, h's
    bf16 slabs [T, window, N] (one split)."""
    tiles, k = sched.shape[1], x.shape[-1]
    in_place = x.ndim == 2
    window = blocks.window if in_place else blocks.rows
    n, n_weights = weights[0].shape[2], len(weights)
    steps = k // blocks.block_k
    splits = blocks.splits_for(tiles * (n // COLUMNS), steps)
    if steps % splits:
        raise ValueError(f"hopper MXFP4 matmul: splits={splits} must divide the {steps} steps of K={k} at "
                         f"block_k={blocks.block_k}")
    if glu_spec is not None and splits != 1:
        raise ValueError(f"hopper MXFP4: the GLU epilogue needs each tile's whole K in one program; got "
                         f"splits={splits}")
    kernel = functools.partial(_kernel, n_weights=n_weights, steps=steps // splits, window=window,
                               in_place=in_place, blocks=blocks, glu_spec=glu_spec)
    by_rows = blocks.outputs == "rows" and glu_spec is None
    if glu_spec is not None:
        out_type = jax.ShapeDtypeStruct((tiles, window, n), jnp.bfloat16)
    else:
        out_type = jax.ShapeDtypeStruct((splits, rows_out, n_weights, n) if by_rows
                                        else (n_weights, splits, tiles, n, window), jnp.float32)
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(tiles, n // COLUMNS, splits),
        grid_names=("tile", "col", "split"),
        kernel_name=launch_name(n_weights, glu_spec is not None),
        scratch_types=[plgpu.SMEM((window, COLUMNS), jnp.bfloat16) if glu_spec is not None
                       else plgpu.SMEM((n_weights, COLUMNS, window), jnp.float32)]
        + ([plgpu.SMEM((window, n_weights, COLUMNS), jnp.float32)] if by_rows else [])
        + ([plgpu.SMEM((COLUMNS, blocks.inputs_per_mma), jnp.bfloat16, transforms=X_TRANSFORMS)]
           if blocks.a_operand == "smem" else []),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(sched, x, *(part for w in weights for part in (w.packed, w.scale)))


def _multiprocessors() -> int:
    """The GPU's multiprocessors (132 on an H100 / H200 SXM; 132 off the GPU, where the launch is only lowered)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or _SMS) if jax.default_backend() == "gpu" else _SMS


def _in_place_rows(x, rows: int):
    """[M, K] -> [M', K] with zero rows after: M' a multiple of `ALIGN` (the tiled copies need whole 8-row
    tiles) with `rows` more, so that the window of `rows + ALIGN` rows from any row below M rounded down to
    `ALIGN` lies inside (the copies would read zeros past the end anyway; the margin keeps them in bounds)."""
    m = x.shape[0]
    return jnp.pad(x, ((0, -(-m // ALIGN) * ALIGN + rows - m), (0, 0)))


def _settled(*arrays):
    """`arrays` computed once and written out as they are: XLA fuses nothing across this point."""
    return lax.optimization_barrier(arrays)


def sorted_schedule(group_sizes, m: int, rows: int):
    """[4, T] int32: `schedule.tile_schedule` of `m` sorted rows in tiles of `rows`, with each tile's first
    output row (a tile's rows are its output rows)."""
    sched = tile_schedule(group_sizes, m, rows)
    return jnp.concatenate([sched, sched[1:2]])


def _tile_rows(sched, rows: int):
    """([T, rows] the row of lhs at each slab row of each tile, [T, rows] whether the tile holds it)."""
    index = sched[1][:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]
    return index, index < sched[2][:, None]


def sorted_inputs(lhs, sched, blocks: HopperMxfp4Blocks, row_source=None):
    """The activations a launch over `sched` reads, bf16 in `k_order`: per tile its own slab
    [T, rows, K] (zeros past the tile's last row), or with `blocks.activations="rows"` the sorted rows in place;
    and the row of lhs each tile's output column 0 holds [T]. `row_source`: optional [M] int, the row of lhs that
    sorted row r is (lhs then unsorted: its rows are reordered and gathered once, straight into the slabs);
    default lhs's rows are the sorted rows."""
    m, tm = lhs.shape[0] if row_source is None else row_source.shape[0], blocks.rows
    ordered = k_order(lhs.astype(jnp.bfloat16), blocks)
    if blocks.activations == "rows":
        ordered = ordered if row_source is None else ordered[row_source]
        return _in_place_rows(ordered, tm), sched[1] // ALIGN * ALIGN
    rows, live = _tile_rows(sched, tm)
    # Each tile's rows as its own slab (zeros past the tile's last row): the activations a program
    # reads start on a whole tile, as the copies into the tiled shared-memory buffers need. The rows are
    # reordered before the gather: the slabs (every tile padded to `rows`) can be several times larger.
    # The reordered rows and each slab row's source are written out first (`_settled`): fused into the gather,
    # XLA recomputed the row index and the schedule's cumulative sums for every element of the slabs (run 32,
    # 64 tokens of Kimi-Linear with outputs="rows": the gate/up and down slabs 36 and 16 us; run 40, the model's
    # decode at B = 16 with the GLU hand-off, whose gated launch writes tiles: 17 us a layer against 4).
    source = jnp.minimum(rows, m - 1)
    source = source if row_source is None else row_source[source]
    ordered, source, live = _settled(ordered, source, live)
    return jnp.where(live[..., None], ordered[source], 0), sched[1]


def products_by_row(out, sched, origin, group_sizes, m: int, blocks: HopperMxfp4Blocks):
    """`launch`'s products over sorted rows -> [W, M, N] fp32, row r the products of lhs row r (zero past
    sum(group_sizes)); `origin`: `sorted_inputs`'s row of each tile's column 0."""
    covered = jnp.arange(m) < jnp.sum(group_sizes)
    if blocks.outputs == "rows":
        return jnp.where(covered[None, :, None], out, 0.0)
    # Row r of the output is column r - origin of its tile's [N, window] block.
    rows, live = _tile_rows(sched, blocks.rows)
    tile_of = jnp.zeros((m,), jnp.int32).at[jnp.where(live, rows, m)].set(
        jnp.broadcast_to(jnp.arange(sched.shape[1], dtype=jnp.int32)[:, None], rows.shape), mode="drop")
    column = jnp.clip(jnp.arange(m) - origin[tile_of], 0, out.shape[-1] - 1)
    per_row = out[:, tile_of, :, column]                                                     # [M, W, N]
    return jnp.where(covered[None, :, None], jnp.moveaxis(per_row, 1, 0), 0.0)


def _products(lhs, weights, group_sizes, blocks: HopperMxfp4Blocks, interpret: bool):
    """Per row r of `lhs` (sorted by group) and each weight w: lhs[r] @ W_w[g(r)] in fp32 -> [W, M, N]."""
    m = lhs.shape[0]
    sched = sorted_schedule(group_sizes, m, blocks.rows)
    x, origin = sorted_inputs(lhs, sched, blocks)
    out = launch(sched, x, weights, m, blocks, interpret, sorted_rows=True)
    return products_by_row(out, sched, origin, group_sizes, m, blocks)


def _pair_products(lhs, weights, group, valid, repeat: int, blocks: HopperMxfp4Blocks, interpret: bool):
    """Unsorted pairs, one tile each: lhs[p // repeat] @ W_w[group[p]] in fp32 where valid[p], else 0
    -> [W, P, N]. The tile's activations: a slab with the pair's row first and zeros after it, or
    (`blocks.activations="rows"`) a window of the rows of `lhs` around the pair's own."""
    pairs = group.shape[0]
    index = jnp.arange(pairs, dtype=jnp.int32)
    token = index // repeat
    sched = jnp.stack([jnp.where(valid, group, 0).astype(jnp.int32), token, token + valid.astype(jnp.int32), index])
    ordered = k_order(lhs.astype(jnp.bfloat16), blocks)     # before the repeat and the padding rows
    if blocks.activations == "rows":
        out = launch(sched, _in_place_rows(ordered, blocks.rows), weights, pairs, blocks, interpret,
                     sorted_rows=False)
        if blocks.outputs == "tiles":
            out = jnp.moveaxis(out[:, index, :, token % ALIGN], 0, 1)       # column: token - token // 8 * 8
    else:
        slabs = jnp.zeros((pairs, blocks.rows, lhs.shape[1]), jnp.bfloat16).at[:, 0].set(
            jnp.repeat(ordered, repeat, axis=0))
        out = launch(sched, slabs, weights, pairs, blocks, interpret, sorted_rows=False)
        if blocks.outputs == "tiles":
            out = out[..., 0]
    return jnp.where(valid[None, :, None], out, 0.0)


def check_operands(lhs, weights, group_sizes, blocks: HopperMxfp4Blocks, permuted: bool = False):
    """Refuses weights, activations, group sizes (None: pairs, checked by `_check_pairs`) and settings
    the kernel cannot take, in one line each. `permuted`: the weights must be `HandOffColumns` (the GLU
    hand-off's gated launch); else they must not be, as their permuted columns would come out silently in the
    wrong order."""
    for w in weights:
        if not isinstance(w, Mxfp4Columns):
            raise ValueError(f"hopper MXFP4 matmul: weights must be Mxfp4Columns (`to_columns`), "
                             f"got {type(w).__name__}")
        if isinstance(w, HandOffColumns) and not permuted:
            raise ValueError("hopper MXFP4 matmul: weights from hand_off_columns (columns in a hand-off order) are "
                             "for the gate and up of grouped_mlp_hopper_mxfp4(hand_off='glu') and "
                             "routed_mlp_hopper_mxfp4 only")
        if permuted and not isinstance(w, HandOffColumns):
            raise ValueError("hopper MXFP4 matmul: hand_off='glu' takes the gate and up weights from "
                             f"hand_off_columns (columns in a hand-off order), got {type(w).__name__}")
        _validated(w)
    if permuted and len({type(w) for w in weights}) > 1:
        raise ValueError("hopper MXFP4 matmul: the gate and up weights are in different hand-off orders ("
                         f"{', '.join(type(w).__name__ for w in weights)}); give both the same "
                         "hand_off_columns(.., code_load=...)")
    g, k, n = weights[0].shape
    if any(w.shape != weights[0].shape for w in weights):
        raise ValueError(f"hopper MXFP4 matmul: gate and up weights differ: {[w.shape for w in weights]}")
    if lhs.ndim != 2 or lhs.shape[1] != k or (group_sizes is not None and group_sizes.shape != (g,)):
        raise ValueError(f"hopper MXFP4 matmul: expected lhs [M, {k}] and group_sizes [{g}] for weights "
                         f"[{g}, {k}, {n}]; got {lhs.shape} and {getattr(group_sizes, 'shape', None)}")
    if k % blocks.block_k:
        raise ValueError(f"hopper MXFP4 matmul: K={k} must be a multiple of block_k={blocks.block_k}")
    if n % COLUMNS:
        raise ValueError(f"hopper MXFP4 matmul: N={n} must be a multiple of {COLUMNS}")
    if blocks.launch == "persistent" and group_sizes is not None and not persistent_takes(n):
        raise ValueError(f"hopper MXFP4 matmul: launch='persistent' needs N a multiple of 128, got N={n}")
    if group_sizes is None and blocks.launch == "persistent":   # pairs run the grid launch
        blocks = dataclasses.replace(blocks, launch="grid")
    if blocks.smem_bytes(len(weights)) > _SMEM_BYTES:
        raise ValueError(f"hopper MXFP4 matmul: {blocks} needs {blocks.smem_bytes(len(weights))} bytes of shared "
                         f"memory for {len(weights)} weight(s); at most {_SMEM_BYTES} (fewer rows, stages or block_k)")


def resolve_blocks(blocks, interpret, k_dim: int, rows_per_group: float = 1.0, n_weights: int = 1):
    """(`blocks`, or the default of `HopperMxfp4Blocks.for_backend` for this K, rows per group and weights;
    whether the kernel runs interpreted), refusing settings interpret mode cannot run."""
    interpreted = default_interpret() if interpret is None else interpret
    if interpreted and blocks is not None and blocks.decode != "exact":
        raise ValueError(f"HopperMxfp4Blocks: decode={blocks.decode!r} is inline PTX, which runs compiled only; "
                         f"interpret mode needs decode='exact'")
    if interpreted and blocks is not None and blocks.launch == "persistent":
        raise ValueError("HopperMxfp4Blocks: launch='persistent' runs compiled only (interpret mode cannot run its "
                         "accumulators through the item loop); interpret mode needs launch='grid'")
    if not interpreted and blocks is not None and blocks.code_load == "words" and blocks.decode == "exact":
        raise ValueError("HopperMxfp4Blocks: code_load='words' with decode='exact' runs in interpret mode only; "
                         "compiled, the word decode is decode='bits' or 'scaled'")
    return (blocks or HopperMxfp4Blocks.for_backend(interpreted, k_dim, rows_per_group, n_weights)), interpreted


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def grouped_matmul_hopper_mxfp4(lhs, rhs: Mxfp4Columns, group_sizes, row_scale=None, *,
                                blocks: HopperMxfp4Blocks | None = None, interpret: bool | None = None):
    """out[r] = lhs[r] @ W[g(r)] (times row_scale[r]) for rows sorted by group, W packed MXFP4.

    Args:
      lhs: [M, K] rows sorted by group (bf16; other dtypes are rounded to bf16 for the MMA).
      rhs: Mxfp4Columns of W [G, K, N]. group_sizes: [G] int32 (sum <= M).
      row_scale: optional [M] per-row factor; the output is then fp32.
      blocks: launch settings (default `HopperMxfp4Blocks.for_backend`). interpret: default off the GPU.
    Returns:
      [M, N] in lhs's dtype (fp32 with row_scale); rows past sum(group_sizes) are zero.
    """
    blocks, interpreted = resolve_blocks(blocks, interpret, lhs.shape[-1], lhs.shape[0] / rhs.shape[0], 1)
    check_operands(lhs, (rhs,), group_sizes, blocks)
    out = _products(lhs, (rhs,), group_sizes, blocks, interpreted)[0]
    if row_scale is None:
        return out.astype(lhs.dtype)
    return out * row_scale.astype(jnp.float32)[:, None]


@functools.partial(jax.jit, static_argnames=("spec", "blocks", "interpret"))
def grouped_glu_hopper_mxfp4(lhs, w_gate: Mxfp4Columns, w_up: Mxfp4Columns, group_sizes, *,
                             spec: GluSpec = GluSpec(), blocks: HopperMxfp4Blocks | None = None,
                             interpret: bool | None = None):
    """act(lhs[r] @ W_gate[g(r)], lhs[r] @ W_up[g(r)]) for rows sorted by group: both products from one
    launch (each program streams both weights' columns). Shapes as `grouped_matmul_hopper_mxfp4`;
    -> [M, F] in lhs's dtype, rows past sum(group_sizes) zero."""
    blocks, interpreted = resolve_blocks(blocks, interpret, lhs.shape[-1], lhs.shape[0] / w_gate.shape[0], 2)
    check_operands(lhs, (w_gate, w_up), group_sizes, blocks)
    gate, up = _products(lhs, (w_gate, w_up), group_sizes, blocks, interpreted)
    return glu(gate, up, spec).astype(lhs.dtype)


def _check_pairs(lhs, weights, group, valid, repeat: int, blocks: HopperMxfp4Blocks):
    check_operands(lhs, weights, None, blocks)
    if repeat < 1 or group.ndim != 1 or group.shape != valid.shape or group.shape[0] != lhs.shape[0] * repeat:
        raise ValueError(f"hopper MXFP4 pairs: expected group and valid [M] with M = lhs rows x repeat; got lhs "
                         f"{lhs.shape}, group {group.shape}, valid {valid.shape}, repeat {repeat}")


@functools.partial(jax.jit, static_argnames=("repeat", "blocks", "interpret"))
def pair_matmul_hopper_mxfp4(lhs, rhs: Mxfp4Columns, group, valid, row_scale=None, *, repeat: int = 1,
                             blocks: HopperMxfp4Blocks | None = None, interpret: bool | None = None):
    """Unsorted pairs, one program per pair and column block (no sort, for a few tokens):
    out[p] = lhs[p // repeat] @ W[group[p]] (times row_scale[p]) where valid[p], else 0.

    Args:
      lhs: [M / repeat, K]. rhs: Mxfp4Columns of W [G, K, N]. group: [M] int32 in [0, G). valid: [M] bool.
      row_scale: optional [M]; the output is then fp32. blocks / interpret: as `grouped_matmul_hopper_mxfp4`.
    Returns:
      [M, N] in lhs's dtype (fp32 with row_scale).
    """
    blocks, interpreted = resolve_blocks(blocks, interpret, lhs.shape[-1])
    _check_pairs(lhs, (rhs,), group, valid, repeat, blocks)
    out = _pair_products(lhs, (rhs,), group, valid, repeat, blocks, interpreted)[0]
    if row_scale is None:
        return out.astype(lhs.dtype)
    return out * jnp.where(valid, row_scale.astype(jnp.float32), 0.0)[:, None]


@functools.partial(jax.jit, static_argnames=("spec", "repeat", "blocks", "interpret"))
def pair_glu_hopper_mxfp4(lhs, w_gate: Mxfp4Columns, w_up: Mxfp4Columns, group, valid, *, spec: GluSpec = GluSpec(),
                          repeat: int = 1, blocks: HopperMxfp4Blocks | None = None, interpret: bool | None = None):
    """Unsorted pairs: act(x @ W_gate[group[p]], x @ W_up[group[p]]) with x = lhs[p // repeat] where valid[p],
    else 0. Shapes as `pair_matmul_hopper_mxfp4`; -> [M, F] in lhs's dtype."""
    blocks, interpreted = resolve_blocks(blocks, interpret, lhs.shape[-1], n_weights=2)
    _check_pairs(lhs, (w_gate, w_up), group, valid, repeat, blocks)
    gate, up = _pair_products(lhs, (w_gate, w_up), group, valid, repeat, blocks, interpreted)
    return glu(gate, up, spec).astype(lhs.dtype)
