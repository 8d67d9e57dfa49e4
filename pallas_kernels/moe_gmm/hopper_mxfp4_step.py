"""The pieces both Hopper MXFP4 launches share: one pipeline step's decode and MMAs, the copy of a tile's
products out by rows, and the gated launch's GLU epilogue. `hopper_mxfp4` (a program per tile and column block)
and `hopper_mxfp4_persistent` (a program per multiprocessor walking its share of the work) call them;
`hopper_mxfp4`'s docstring has the math.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe_gmm.activation import glu
from pallas_kernels.moe_gmm.hopper_mxfp4_decode import (DECODERS, decode_scaled, decode_words, decode_words_exact,
                                                         scaled_factor_bits, scaled_pair_bits)
from pallas_kernels.moe_gmm.mxfp4 import GROUP

COLUMNS = 64                      # output columns of one warpgroup: the M side of its MMA
PER_GROUP = GROUP // 2            # packed bytes of one scale group along a column
ALIGN = 8                         # rows of one tile of the activations' shared-memory buffer (copies start on one)
X_TRANSFORMS = (plgpu.TilingTransform((8, PER_GROUP)), plgpu.SwizzleTransform(32))
CODE_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))


def launch_name(n_weights: int, glu: bool, persistent: bool = False) -> str:
    """A launch's kernel name, as profiles show it (with Mosaic GPU's "_mosaic_gpu_kernel" after it):
    "routed_experts_mxfp4_" then "glu" (gate and up with the GLU epilogue), "gate_up" or "matmul" (one weight),
    and "_persistent" for the persistent launch. Profiles tell the launches apart by it, and file them under the
    model's "routed_experts" scope (benchmarks/profile_summary.py), where this kernel is the routed experts' only
    (shared experts given to the pair ops run the reference)."""
    kind = "glu" if glu else "gate_up" if n_weights == 2 else "matmul"
    return f"routed_experts_mxfp4_{kind}" + ("_persistent" if persistent else "")


def multiply_step(x_smem, w_smem, acc_refs, *, block_k: int, decode: str, mma_inputs: int, a_smem=None,
                  columns=None, code_load: str = "pairs"):
    """One pipeline step of a warpgroup: for each weight w, acc_refs[w] [64, window] += its 64 columns' decoded
    weights [64, block_k] @ x_smem^T, then waits for the MMAs.

    x_smem: [window, block_k] bf16, each scale group's inputs as its 16 even then its 16 odd ones, or with
      `code_load="words"` in `word_order` (the codes loaded four bytes a thread and decoded a word at a time:
      `hopper_mxfp4_decode.decode_words`; in interpret mode, `decode="exact"`, the same order by a reshape).
    w_smem: per weight the packed codes [C, block_k / 2] and the E8M0 scales [block_k / 32, C]; C = 64, or
      `columns` (a `pl.ds` of 64) picks the warpgroup's columns of a wider block.
    mma_inputs: inputs one MMA call takes (16, 32, or block_k). a_smem: [64, mma_inputs] bf16 to pass the
      decoded weights through shared memory (the form interpret mode runs), None: from registers.
    """
    layout = plgpu.Layout.WGMMA
    row_layout = layout.reduce(1)
    groups = block_k // GROUP
    per_mma = mma_inputs // PER_GROUP       # [64, 16] pieces (low or high nibbles of a group) a call
    pick = (lambda ref: ref) if columns is None else (lambda ref: ref.at[columns])
    for w, acc_ref in enumerate(acc_refs):
        p_smem, s_smem = w_smem[2 * w], w_smem[2 * w + 1]
        words = code_load == "words" and decode != "exact"
        codes = plgpu.load(pick(p_smem), layout=plgpu.Layout.WGMMA_8BIT if words else layout)   # [64, bk/2] u8
        pieces, issued = [], 0   # piece 2j: group j's low nibbles (its even inputs), 2j + 1: its odd ones
        for j in range(groups):
            factor = plgpu.load(pick(s_smem.at[j]), layout=row_layout)            # [64] u8 E8M0
            group_codes = codes[:, PER_GROUP * j:PER_GROUP * (j + 1)]
            if words and decode == "scaled":    # the pair (2^(s - 1), 2^(s - 1)): bits (s + 126) << 7 twice
                pieces += list(decode_words(group_codes, scaled_pair_bits(factor)))
            elif words:                         # times 2^126, then the scale as the chunk decodes take it
                factor = lax.bitcast_convert_type(factor.astype(jnp.int16) << 7, jnp.bfloat16)
                factor = lax.broadcast_in_dim(factor, (COLUMNS, PER_GROUP), [0])
                lo, hi = decode_words(group_codes)
                pieces += [lo * factor, hi * factor]
            elif decode == "scaled":      # 2^126 x 2^(s - 127): bf16 exponent s + 126 (255, inf, past the range)
                factor = lax.broadcast_in_dim(lax.bitcast_convert_type(scaled_factor_bits(factor), jnp.bfloat16),
                                              (COLUMNS, PER_GROUP), [0])
                pieces += list(decode_scaled(group_codes, factor))
            else:
                factor = lax.bitcast_convert_type(factor.astype(jnp.int16) << 7, jnp.bfloat16)
                factor = lax.broadcast_in_dim(factor, (COLUMNS, PER_GROUP), [0])
                lo, hi = (decode_words_exact if code_load == "words" else DECODERS[decode])(group_codes)
                pieces += [lo * factor, hi * factor]
            while len(pieces) - issued >= per_mma:     # x_smem's columns 16 p .. 16 p + 15: piece p's inputs
                run = pieces[issued:issued + per_mma]
                a = run[0] if per_mma == 1 else jnp.concatenate(run, axis=1)
                if a_smem is not None:
                    plgpu.wgmma_wait(0)          # the previous MMA is done reading the buffer
                    a_smem[...] = a
                    plgpu.commit_smem()
                    a = a_smem
                x_part = x_smem.at[:, pl.ds(PER_GROUP * issued, PER_GROUP * per_mma)]
                plgpu.wgmma(acc_ref, a, x_part.transpose((1, 0)))
                issued += per_mma
    plgpu.wgmma_wait(0)


def copy_out_rows(o_smem, t_smem, out_ref, start, count, out_first, col, window: int, rows: int):
    """The products of a tile's `count` rows (from column `start` of each weight's [64, window] block in
    `o_smem`) into rows out_first .. out_first + count - 1 of `out_ref` [rows out, weights, N], columns of
    block `col`: the blocks transposed into `t_smem` [window, weights, 64] in one strided read of shared
    memory (a value a thread and load, window x weights x 64 / 128 loads a thread), then one copy per power
    of two in `count` (16 + 4 + 1 rows for 21), so no copy writes a row of another tile."""
    n_weights = o_smem.shape[0]
    t_smem[...] = plgpu.load(o_smem.transpose((2, 0, 1)),
                             layout=plgpu.Layout.WG_STRIDED((window, n_weights, COLUMNS), 1))
    plgpu.commit_smem()
    size = 1 << (rows.bit_length() - 1)                 # the largest power of two <= rows (count <= rows)
    while size:
        @pl.when((count & size) != 0)
        def _(size=size):
            done = count & ~(2 * size - 1)              # the rows the larger pieces took
            plgpu.copy_smem_to_gmem(t_smem.at[pl.ds(start + done, size)],
                                    out_ref.at[pl.ds(out_first + done, size), :, pl.ds(col * COLUMNS, COLUMNS)])
        size //= 2


def write_glu_slab(gate, up, h_smem, out_ref, spec):
    """The gated launch's epilogue when it hands h to the down launch (`hopper_mxfp4_mlp`, hand_off="glu"):
    act(gate, up) on the tile's accumulators ([64, window] fp32 each, in the MMA's register layout), rounded to
    bf16, stored transposed into `h_smem` [window, 64] and copied to `out_ref` [window, 64]: the tile's slab
    rows, these 64 columns. (Read back from shared memory transposed and then rounded, the same epilogue took
    Mosaic GPU 60-135 s to lower on the CPU; this one 3-4 s.)"""
    h_smem.transpose((1, 0))[...] = glu(gate, up, spec).astype(jnp.bfloat16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_smem, out_ref)
