"""The Hopper (Mosaic GPU) grouped matmul on packed MXFP4 weights against the references over the
dequantised weights.

On the CPU the kernel runs in Mosaic GPU's interpret mode in the forms it supports (the exact decode,
the decoded weights through shared memory); every form is lowered for CUDA (the whole Pallas -> Mosaic
GPU lowering and layout inference, no GPU needed); and the PTX decode's text is executed instruction by
instruction by a small interpreter of the four instructions it uses, over every 16-bit chunk of codes,
against the E2M1 table. On a GPU every form runs compiled.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_matrix import covering_rows
from tolerances import assert_close, kernel_dtype

from pallas_kernels.moe_gmm import (GluSpec, Mxfp4Weight, grouped_glu, grouped_glu_reference, grouped_matmul_reference,
                                    hopper_mxfp4, pair_glu_reference, pair_matmul_reference)
from pallas_kernels.moe_gmm.hopper_mxfp4 import (HopperMxfp4Blocks, Mxfp4Columns, even_odd, from_checkpoint_columns,
                                                 grouped_glu_hopper_mxfp4, grouped_matmul_hopper_mxfp4, k_order,
                                                 pair_glu_hopper_mxfp4, pair_matmul_hopper_mxfp4, runs_here,
                                                 to_columns, word_order)
from pallas_kernels.moe_gmm.hopper_mxfp4_decode import (PTX_DECODE, PTX_DECODE_BITS, PTX_DECODE_SCALED,
                                                         PTX_DECODE_WORD, PTX_DECODE_WORD_SCALED, SCALED_MAX_SCALE,
                                                         WORD_BYTES, decode_exact, decode_table_bits,
                                                         scaled_factor_bits, scaled_pair_bits)
from pallas_kernels.moe_gmm.hopper_mxfp4_persistent import launch_persistent
from pallas_kernels.moe_gmm.mxfp4 import E2M1, dequantize, from_checkpoint_layout

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="Mosaic GPU kernels compile on a GPU only")
FORMS = {"bits_registers": HopperMxfp4Blocks(), "exact_registers": HopperMxfp4Blocks(decode="exact"),
         "ptx_registers": HopperMxfp4Blocks(decode="ptx"), "scaled_registers": HopperMxfp4Blocks(decode="scaled"),
         "scaled_mma_step": HopperMxfp4Blocks(decode="scaled", mma_inputs=0),
         "words_mma_step": HopperMxfp4Blocks(code_load="words", mma_inputs=0),
         "words_scaled_rows_out": HopperMxfp4Blocks(code_load="words", decode="scaled", mma_inputs=0, outputs="rows"),
         "words_scaled_group": HopperMxfp4Blocks(code_load="words", decode="scaled", mma_inputs=32),
         "words_scaled_k128_stages4": HopperMxfp4Blocks(code_load="words", decode="scaled", mma_inputs=0, block_k=128,
                                                        stages=4, outputs="rows"),
         "ptx_smem": HopperMxfp4Blocks(decode="ptx", a_operand="smem"),
         "exact_smem": HopperMxfp4Blocks(decode="exact", a_operand="smem"),
         "rows16_k128_stages2": HopperMxfp4Blocks(rows=16, block_k=128, stages=2),
         "k512_stages4": HopperMxfp4Blocks(block_k=512, stages=4),
         "k128_splits_auto": HopperMxfp4Blocks(block_k=128, splits=0),
         "mma_group": HopperMxfp4Blocks(mma_inputs=32), "mma_step": HopperMxfp4Blocks(mma_inputs=0),
         "smem_mma_step": HopperMxfp4Blocks(a_operand="smem", mma_inputs=0),
         "rows_in_place": HopperMxfp4Blocks(activations="rows"),
         "rows16_in_place_splits_auto": HopperMxfp4Blocks(rows=16, block_k=128, splits=0, activations="rows"),
         "rows_out": HopperMxfp4Blocks(outputs="rows"),
         "rows_in_place_out": HopperMxfp4Blocks(activations="rows", outputs="rows"),
         "rows24_in_place_out_splits_auto": HopperMxfp4Blocks(rows=24, block_k=128, splits=0, activations="rows",
                                                              outputs="rows")}
# The persistent launch (N a multiple of 128); `programs=3`: each program walks many items, so its pipeline
# runs from one item into the next and its accumulators are cleared between them.
PERSISTENT = {"persistent_rows_out": HopperMxfp4Blocks(launch="persistent", outputs="rows"),
              "persistent_tiles_out": HopperMxfp4Blocks(launch="persistent"),
              "persistent_3_programs": HopperMxfp4Blocks(launch="persistent", outputs="rows", programs=3),
              "persistent_3_programs_tiles_k128": HopperMxfp4Blocks(launch="persistent", programs=3, block_k=128,
                                                                    stages=6),
              "persistent_rows16_mma_step": HopperMxfp4Blocks(launch="persistent", rows=16, mma_inputs=0,
                                                              programs=5),
              "persistent_ptx_stages2": HopperMxfp4Blocks(launch="persistent", decode="ptx", stages=2, programs=7),
              "persistent_words_scaled": HopperMxfp4Blocks(launch="persistent", code_load="words", decode="scaled",
                                                           mma_inputs=0, programs=5)}


def _weight(rng, g, k, n, top: int = SCALED_MAX_SCALE) -> Mxfp4Weight:
    """Every E2M1 code, scales around 2^0 (E8M0 124..top: no group's products dwarf the others'); by default up to
    the largest the compiled default decode of 8-row tiles ("scaled") takes exactly."""
    return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (g, k // 2, n), dtype=np.uint8)),
                       jnp.asarray(rng.integers(124, top + 1, (g, k // 32, n), dtype=np.uint8)))


def _top_scale(blocks: HopperMxfp4Blocks) -> int:
    """The largest E8M0 byte the tests give `blocks`: decode="scaled" takes up to SCALED_MAX_SCALE."""
    return SCALED_MAX_SCALE if blocks.decode == "scaled" else 130


def _blocks(interpret: bool, **fields) -> HopperMxfp4Blocks:
    return HopperMxfp4Blocks.for_backend(interpret, **fields)


# Group sizes: an empty group, a group longer than a tile, rows past the groups (zeros).
CASES = [([3, 0, 5, 3], 12, 8), ([0, 19, 1, 0, 4], 26, 8), ([2, 0, 0, 17], 20, 16)]


IO_FORMS = [("slab", "tiles"), ("rows", "tiles"), ("slab", "rows"), ("rows", "rows")]   # activations, outputs


# In interpret mode: every form on the first case, then each row that brings a case or, for outputs="rows", a tile
# height no earlier row did (kernel_matrix).
@pytest.mark.parametrize("sizes,m,rows,activations,outputs", covering_rows(
    [(*case, *form) for case in CASES for form in IO_FORMS],
    lambda sizes, m, rows, activations, outputs: [("case", tuple(sizes), m, rows), ("form", activations, outputs),
                                                  *([("rows out", rows)] if outputs == "rows" else [])]))
def test_grouped_matmul_equals_the_reference(rng, interpret, sizes, m, rows, activations, outputs):
    """activations="rows": each tile reads a window of rows + 8 sorted rows from an 8-row boundary, the
    rows of its neighbours included (their products discarded); outputs="rows": each tile writes its own
    rows' products into [M, N] (1, 2, 4, 8 and 16-row pieces: groups of 1 to 19 rows)."""
    g, k, n = len(sizes), 256, 128
    w = _weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    scale = jnp.asarray(rng.uniform(0.1, 1.0, (m,)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    dense = dequantize(w, jnp.float32)
    blocks = _blocks(interpret, rows=rows, block_k=128, activations=activations, outputs=outputs)
    out = grouped_matmul_hopper_mxfp4(x, to_columns(w), group_sizes, blocks=blocks, interpret=interpret)
    assert out.dtype == jnp.bfloat16
    assert_close("matmul", out, grouped_matmul_reference(x.astype(jnp.float32), dense, group_sizes), dtype=jnp.bfloat16)
    scaled = grouped_matmul_hopper_mxfp4(x, to_columns(w), group_sizes, scale, blocks=blocks, interpret=interpret)
    assert scaled.dtype == jnp.float32
    assert_close("scaled", scaled, grouped_matmul_reference(x.astype(jnp.float32), dense, group_sizes, scale))
    assert not np.asarray(out[sum(sizes):]).any()


@pytest.mark.parametrize("activations,outputs", [("slab", "rows"), ("rows", "tiles")])
def test_word_loads_put_inputs_and_codes_in_one_order(rng, activations, outputs):
    """code_load="words" in interpret mode (any host): the exact decode takes each group's bytes in WORD_BYTES
    order and the activations come in `word_order`, the order the compiled word decode's pieces have; sorted rows
    (gate and up together, and one projection), pairs and the products hand-off against the references."""
    from pallas_kernels.moe_gmm.hopper_mxfp4_mlp import grouped_mlp_hopper_mxfp4

    sizes, k, n = [3, 0, 9, 2], 128, 128
    m = sum(sizes) + 2
    blocks = HopperMxfp4Blocks(decode="exact", a_operand="smem", code_load="words", block_k=128,
                               activations=activations, outputs=outputs)
    wg, wu, wd = _weight(rng, 4, k, n), _weight(rng, 4, k, n), _weight(rng, 4, n, k)
    dg, du, dd = (dequantize(w, jnp.float32) for w in (wg, wu, wd))
    x = jnp.asarray(rng.standard_normal((m, k)) * 0.1, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    xf = x.astype(jnp.float32)
    h = grouped_glu_hopper_mxfp4(x, to_columns(wg), to_columns(wu), group_sizes, blocks=blocks, interpret=True)
    assert_close("glu", h, grouped_glu_reference(xf, dg, du, group_sizes), dtype=jnp.bfloat16)
    mm = grouped_matmul_hopper_mxfp4(x, to_columns(wg), group_sizes, blocks=blocks, interpret=True)
    assert_close("matmul", mm, grouped_matmul_reference(xf, dg, group_sizes), dtype=jnp.bfloat16)
    group = jnp.asarray(rng.integers(0, 4, 6), jnp.int32)
    valid = jnp.asarray([True, True, False, True, True, True])
    pairs = pair_matmul_hopper_mxfp4(x[:3], to_columns(wg), group, valid, repeat=2, blocks=blocks, interpret=True)
    assert_close("pairs", pairs, pair_matmul_reference(xf[:3], dg, group, valid, repeat=2), dtype=jnp.bfloat16)
    if activations == "slab":
        y = grouped_mlp_hopper_mxfp4(x, to_columns(wg), to_columns(wu), to_columns(wd), group_sizes, blocks=blocks,
                                     interpret=True)
        hb = grouped_glu_reference(xf, dg, du, group_sizes).astype(jnp.bfloat16).astype(jnp.float32)
        assert_close("mlp", y, grouped_matmul_reference(hb, dd, group_sizes), dtype=jnp.bfloat16)


def test_word_loads_refuse_what_they_cannot_run(rng):
    x = jnp.zeros((8, 128), jnp.bfloat16)
    w = to_columns(_weight(rng, 2, 128, 64))
    sizes = jnp.asarray([5, 3], jnp.int32)
    with pytest.raises(ValueError, match="not decode='ptx'"):
        HopperMxfp4Blocks(code_load="words", decode="ptx")
    with pytest.raises(ValueError, match="code_load must be one of"):
        HopperMxfp4Blocks(code_load="bytes")
    with pytest.raises(ValueError, match="interpret mode only"):
        grouped_matmul_hopper_mxfp4(x, w, sizes, blocks=HopperMxfp4Blocks(code_load="words", decode="exact"),
                                    interpret=False)
    from pallas_kernels.moe_gmm.hopper_mxfp4_mlp import grouped_mlp_hopper_mxfp4, hand_off_columns
    with pytest.raises(ValueError, match="code_load='words' does not read"):
        grouped_mlp_hopper_mxfp4(x, hand_off_columns(w), hand_off_columns(w), to_columns(_weight(rng, 2, 64, 128)),
                                 sizes, blocks=HopperMxfp4Blocks(code_load="words", decode="exact", a_operand="smem",
                                                                 block_k=128), interpret=True, hand_off="glu")


@pytest.mark.parametrize("activations,outputs", IO_FORMS)
def test_tiles_in_reverse_order_and_uneven_row_counts(rng, interpret, monkeypatch, activations, outputs):
    """24-row tiles (not a power of two: outputs="rows" copies 7 rows as 4 + 2 + 1, 23 as 16 + 4 + 2 + 1, 24 as
    16 + 8) with the schedule's tiles in reverse order: interpret mode runs the programs in grid order, so a
    program that wrote past its own rows would clobber a tile that already ran."""
    from pallas_kernels.moe_gmm import hopper_mxfp4
    forward = hopper_mxfp4.tile_schedule
    monkeypatch.setattr(hopper_mxfp4, "tile_schedule", lambda *args: forward(*args)[:, ::-1])
    sizes, m, k, n = [7, 23, 0, 24, 5], 62, 128, 64          # shapes of this test only (no cached trace)
    w = _weight(rng, len(sizes), k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    blocks = _blocks(interpret, rows=24, block_k=128, activations=activations, outputs=outputs)
    out = grouped_matmul_hopper_mxfp4(x, to_columns(w), group_sizes, blocks=blocks, interpret=interpret)
    ref = grouped_matmul_reference(x.astype(jnp.float32), dequantize(w, jnp.float32), group_sizes)
    assert_close("reversed tiles", out, ref, dtype=jnp.bfloat16)


@pytest.mark.parametrize("spec,splits,mma_inputs,activations", [
    (GluSpec(), 1, 16, "slab"), (GluSpec("situ", situ_beta=4.0, situ_linear_beta=8.0), 1, 16, "slab"),
    (GluSpec(), 3, 16, "slab"), (GluSpec(), 1, 32, "slab"), (GluSpec(), 1, 0, "slab"), (GluSpec(), 3, 16, "rows"),
    (GluSpec(), 3, 16, "rows/out")])
def test_grouped_glu_equals_the_reference_over_several_steps(rng, interpret, spec, splits, mma_inputs, activations):
    """splits=3: each program one of the three steps, their partial sums added after the launch;
    mma_inputs: a scale group's low or high nibbles an MMA, both, or the whole step; activations: the
    tiles' rows gathered into slabs or read in place."""
    g, k, f, m = 3, 384, 64, 10            # three 128-input steps
    wg, wu = _weight(rng, g, k, f), _weight(rng, g, k, f)
    x = jnp.asarray(rng.standard_normal((m, k)) * 0.05, jnp.float32)   # fp32 activations: rounded to bf16
    group_sizes = jnp.asarray([4, 0, 5], jnp.int32)
    out = grouped_glu_hopper_mxfp4(x, to_columns(wg), to_columns(wu), group_sizes, spec=spec,
                                   blocks=_blocks(interpret, block_k=128, splits=splits, mma_inputs=mma_inputs,
                                                  activations=activations.split("/")[0],
                                                  outputs="rows" if activations.endswith("/out") else "tiles"),
                                   interpret=interpret)
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)
    ref = grouped_glu_reference(xb, dequantize(wg, jnp.float32), dequantize(wu, jnp.float32), group_sizes, spec=spec)
    assert out.dtype == jnp.float32
    # the MMA's operands are bf16 (x rounded, the weights exact) and its sums fp32: exact up to their order
    assert_close("glu", out, ref, dtype=kernel_dtype("float32", interpret))


@pytest.mark.parametrize("activations,outputs", IO_FORMS)
def test_pairs_equal_the_reference(rng, interpret, activations, outputs):
    """Unsorted pairs (two experts per token, one pair not valid), both entry points; 11 tokens: the last
    pairs' windows start on row 8."""
    g, k, f, tokens, repeat = 5, 256, 64, 11, 2
    wg, wu = _weight(rng, g, k, f), _weight(rng, g, k, f)
    x = jnp.asarray(jnp.asarray(rng.standard_normal((tokens, k)) * 0.05, jnp.bfloat16), jnp.float32)
    group = jnp.asarray(rng.integers(0, g, tokens * repeat), jnp.int32)
    valid = jnp.asarray(np.arange(tokens * repeat) != 2)
    scale = jnp.asarray(rng.uniform(0.1, 1.0, tokens * repeat), jnp.float32)
    dg, du = dequantize(wg, jnp.float32), dequantize(wu, jnp.float32)
    # auto splits: 22 programs, so each of the 2 steps its own
    blocks = _blocks(interpret, block_k=128, splits=0, activations=activations, outputs=outputs)
    tol = kernel_dtype("float32", interpret)     # fp32 activations that are bf16 values: exact products
    h = pair_glu_hopper_mxfp4(x, to_columns(wg), to_columns(wu), group, valid, repeat=repeat, blocks=blocks,
                              interpret=interpret)
    assert_close("pair glu", h, pair_glu_reference(x, dg, du, group, valid, repeat=repeat), dtype=tol)
    y = pair_matmul_hopper_mxfp4(x, to_columns(wg), group, valid, scale, repeat=repeat, blocks=blocks,
                                 interpret=interpret)
    assert_close("pair matmul", y, pair_matmul_reference(x, dg, group, valid, scale, repeat=repeat), dtype=tol)
    assert not np.asarray(y[2]).any() and not np.asarray(h[2]).any()
    with pytest.raises(ValueError, match="repeat"):
        pair_glu_hopper_mxfp4(x, to_columns(wg), to_columns(wu), group, valid, repeat=3, blocks=blocks)


def test_checkpoint_columns_keep_the_stored_codes(rng):
    g, n, k = 2, 64, 128
    packed = jnp.asarray(rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8))
    scale = jnp.asarray(rng.integers(118, 135, (g, n, k // 32), dtype=np.uint8))
    cols = from_checkpoint_columns(packed, scale)
    assert cols.packed is packed and cols.shape == (g, k, n)
    same = to_columns(from_checkpoint_layout(packed, scale))
    np.testing.assert_array_equal(np.asarray(cols.packed), np.asarray(same.packed))
    np.testing.assert_array_equal(np.asarray(cols.scale), np.asarray(same.scale))


def test_exact_decode_is_the_e2m1_table():
    codes = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
    lo, hi = decode_exact(codes)
    table = np.asarray(E2M1, np.float32)
    np.testing.assert_array_equal(np.asarray(lo, np.float32), table[np.arange(256).reshape(16, 16) & 15])
    np.testing.assert_array_equal(np.asarray(hi, np.float32), table[np.arange(256).reshape(16, 16) >> 4])


# ------------------------------------------------------------------------------------------------
# The PTX decode, executed on the CPU by an interpreter of the instructions it uses
# ------------------------------------------------------------------------------------------------

def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel nibble i & 7) of {b, a}, or, when
    the nibble's bit 3 is set, that byte's sign replicated."""
    a, b, sel = np.broadcast_arrays(a, b, sel)
    pool = np.stack([(a >> s) & 0xFF for s in (0, 8, 16, 24)] + [(b >> s) & 0xFF for s in (0, 8, 16, 24)])
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = np.take_along_axis(pool, (nib & 7)[None], axis=0)[0]
        byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out |= byte << (8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for bit in range(8):
        if lut >> bit & 1:
            out |= (a if bit & 4 else ~a) & (b if bit & 2 else ~b) & (c if bit & 1 else ~c)
    return out & 0xFFFFFFFF


def _bf16_values(bits):
    """The values of bf16 bit patterns (subnormals included: float32 shares bf16's exponent range)."""
    return (np.asarray(bits, np.int64).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _fma_bf16x2(a, b, c):
    """PTX fma.rn.bf16x2 on both halves; every product here is exact, so the result is checked to be
    a bf16 value and returned as its bits."""
    out = np.zeros_like(a)
    for shift in (0, 16):
        half = [(v >> shift) & 0xFFFF for v in (a, b, c)]
        value = (_bf16_values(half[0]) * _bf16_values(half[1]) + _bf16_values(half[2])).astype(np.float32)
        bits = value.view(np.uint32).astype(np.int64)
        assert not np.any(bits & 0xFFFF), "an fma result that bf16 does not hold exactly"
        out |= (bits >> 16) << shift
    return out


def _run_ptx(text: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Executes a decode's PTX (and, prmt, shl, lop3, mov, mul.lo on .b32 and fma.rn.bf16x2) over int64
    arrays holding 32-bit values."""
    regs = dict(inputs)

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else np.int64(int(tok, 0))

    for line in text.strip().splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [s.strip() for s in rest.split(",")]
        args = [np.asarray(val(s), np.int64) for s in srcs]
        if op == "and.b32":
            res = args[0] & args[1]
        elif op == "shl.b32":
            res = (args[0] << args[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            res = (args[0] & 0xFFFFFFFF) >> args[1]
        elif op == "prmt.b32":
            res = _prmt(args[0], args[1], args[2])
        elif op == "lop3.b32":
            res = _lop3(args[0], args[1], args[2], int(args[3]))
        elif op == "mov.b32":
            res = args[0]
        elif op == "mul.lo.u32":
            res = (args[0] * args[1]) & 0xFFFFFFFF
        elif op == "fma.rn.bf16x2":
            res = _fma_bf16x2(*np.broadcast_arrays(*args))
        else:
            raise AssertionError(f"instruction the interpreter does not know: {op}")
        regs[dst] = np.broadcast_to(res, next(iter(inputs.values())).shape).astype(np.int64)
    return regs


def _bf16_bits(values) -> np.ndarray:
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.int64)


def test_ptx_decode_text_gives_every_code_pair_its_e2m1_value():
    """All 65,536 chunks of two code bytes through the PTX text: output 0 holds the low nibbles' bf16
    values (byte 0 in bits 0-15, byte 1 in 16-31), output 1 the high nibbles'."""
    assert set(re.findall(r"^\s*([a-z0-9]+)\.", PTX_DECODE, re.M)) <= {"and", "prmt", "shl", "lop3"}
    chunks = np.arange(1 << 16, dtype=np.int64)
    regs = _run_ptx(PTX_DECODE, {"$2": chunks})
    table = _bf16_bits(E2M1)
    nib = [(chunks >> s) & 15 for s in (0, 4, 8, 12)]              # low0, high0, low1, high1
    np.testing.assert_array_equal(regs["$0"], table[nib[0]] | (table[nib[2]] << 16))
    np.testing.assert_array_equal(regs["$1"], table[nib[1]] | (table[nib[3]] << 16))


def test_bits_decode_text_gives_every_code_pair_its_e2m1_value():
    """The bit-placing decode on all 65,536 chunks gives the table decode's bits exactly (signed zeros
    included), also with junk above the chunk's 16 bits, which its first prmt must ignore."""
    assert set(re.findall(r"^\s*([a-z0-9]+)\.", PTX_DECODE_BITS, re.M)) <= {"and", "prmt", "mul", "mov", "fma"}
    chunks = np.arange(1 << 16, dtype=np.int64)
    table = _bf16_bits(E2M1)
    nib = [(chunks >> s) & 15 for s in (0, 4, 8, 12)]
    for junk in (0, 0x5A3C0000):
        regs = _run_ptx(PTX_DECODE_BITS, {"$2": chunks | junk})
        np.testing.assert_array_equal(regs["$0"], table[nib[0]] | (table[nib[2]] << 16))
        np.testing.assert_array_equal(regs["$1"], table[nib[1]] | (table[nib[3]] << 16))


def test_scaled_decode_text_gives_every_code_pair_its_value_times_its_scale():
    """The bits decode with the scale in its multiply: all 65,536 chunks (junk above them too) times every
    E8M0 scale it takes, 2^(s - 127) for s = 0 .. SCALED_MAX_SCALE, given as the pair 2^(s - 1), bit-exact."""
    assert set(re.findall(r"^\s*([a-z0-9]+)\.", PTX_DECODE_SCALED, re.M)) <= {"and", "prmt", "mul", "mov", "fma"}
    chunks = np.arange(1 << 16, dtype=np.int64) | 0x5A3C0000
    values = np.asarray(E2M1, np.float64)
    nib = [(chunks >> s) & 15 for s in (0, 4, 8, 12)]
    for scale in (0, 1, 60, 117, 127, SCALED_MAX_SCALE):
        pair = ((scale + 126) << 7) * 0x10001
        regs = _run_ptx(PTX_DECODE_SCALED, {"$2": chunks, "$3": np.full_like(chunks, pair)})
        want = [_bf16_bits(values[n] * 2.0 ** (scale - 127)) for n in nib]
        np.testing.assert_array_equal(regs["$0"], want[0] | (want[2] << 16))
        np.testing.assert_array_equal(regs["$1"], want[1] | (want[3] << 16))


def test_scaled_multipliers_are_the_scales_times_2_126_and_inf_past_the_range():
    """The kernel's own expressions for the "scaled" multiplier over all 256 E8M0 bytes: 2^(s - 1) exactly up to
    SCALED_MAX_SCALE, +inf above (loud: zero codes come out NaN, the rest inf), never a wrapped sign bit; the
    word decode's pair is the same bits in both halves."""
    s = jnp.arange(256, dtype=jnp.uint8)
    bits = np.asarray(scaled_factor_bits(s)).astype(np.int64) & 0xFFFF
    values = _bf16_values(bits)
    fits = np.arange(256) <= SCALED_MAX_SCALE
    np.testing.assert_array_equal(values[fits], 2.0 ** (np.arange(256)[fits] - 1.0))
    assert np.all(np.isposinf(values[~fits]))
    pair = np.asarray(scaled_pair_bits(s)).astype(np.int64)
    np.testing.assert_array_equal(pair, bits | (bits << 16))


def test_word_decode_texts_give_every_byte_pair_its_values():
    """The word decode on 32-bit words of four code bytes: outputs 0 / 1 the low nibbles of bytes (0, 2) / (1, 3),
    2 / 3 their high nibbles, each pair times 2^126 x 2^-126 (bits) or its scale (scaled), bit-exact. Every pair of
    bytes 0 and 2 with random bytes 1 and 3, then every pair of bytes 1 and 3 with random bytes 0 and 2."""
    rng = np.random.default_rng(21)
    pairs = np.arange(1 << 16, dtype=np.int64)
    noise = rng.integers(0, 1 << 16, pairs.shape, dtype=np.int64)
    spread = lambda v: (v & 0xFF) | ((v >> 8) << 16)                    # bytes 0, 1 of v -> bytes 0 and 2
    words = np.concatenate([spread(pairs) | (spread(noise) << 8), spread(noise) | (spread(pairs) << 8)])
    values = np.asarray(E2M1, np.float64)
    byte = [(words >> (8 * i)) & 0xFF for i in range(4)]
    for text, scale in ((PTX_DECODE_WORD, 127), (PTX_DECODE_WORD_SCALED, 0), (PTX_DECODE_WORD_SCALED, 120),
                        (PTX_DECODE_WORD_SCALED, SCALED_MAX_SCALE)):
        assert set(re.findall(r"^\s*([a-z0-9]+)\.", text, re.M)) <= {"and", "shr", "mul", "mov", "fma"}
        inputs = {"$4": words} | ({"$5": np.full_like(words, ((scale + 126) << 7) * 0x10001)} if "$5" in text else {})
        regs = _run_ptx(text, inputs)

        def want(nibble, a, b):
            return (_bf16_bits(values[(byte[a] >> nibble) & 15] * 2.0 ** (scale - 127))
                    | (_bf16_bits(values[(byte[b] >> nibble) & 15] * 2.0 ** (scale - 127)) << 16))

        for out, (nibble, a, b) in enumerate(((0, 0, 2), (0, 1, 3), (4, 0, 2), (4, 1, 3))):
            np.testing.assert_array_equal(regs[f"${out}"], want(nibble, a, b), err_msg=f"output {out}, scale {scale}")


def _layout_element(layout, shape, warp: int, lane: int, register: tuple, v: int) -> tuple:
    """The element of a `shape` array in Mosaic GPU's tiled `layout` that `warp`, `lane` hold at `register`, vector
    entry `v`: the offsets of the warp's, the lane's and the register's tile indices and the vector entry, summed
    with the layout's tile strides and read back as an index of `shape`."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    tiled = layout.tiled_tiling_shape
    strides = layout.tiling.tile_strides(tuple(int(s) for s in np.cumprod((shape[1:] + (1,))[::-1])[::-1]))
    minor = strides[-layout.tiled_tiling_rank:]

    def spread(index: int, dims) -> int:
        sizes = [d.times if isinstance(d, fa.Replicated) else tiled[d] for d in dims]
        offset = 0
        for d, size, inner in zip(dims, sizes, [int(np.prod(sizes[i + 1:])) for i in range(len(sizes))]):
            if not isinstance(d, fa.Replicated):
                offset += (index // inner) % size * minor[d]
        return offset

    flat = spread(warp, layout.warp_dims) + spread(lane, layout.lane_dims) + v * minor[layout.vector_dim]
    flat += sum(i * s for i, s in zip(register, strides))
    return tuple(int(i) for i in np.unravel_index(flat, shape))


def test_word_decode_registers_follow_mosaic_gpus_layouts():
    """`decode_words` reads codes register [h] (WGMMA_8BIT) as row r + 8h, bytes 4t .. 4t + 3, writes piece register
    [c, h] (WGMMA) as row r + 8h, columns 8c + 2t and + 1, and the row layout's register [h] is row r + 8h; with its
    PTX ($c: the nibbles of word bytes c and c + 2) piece column s then holds group byte WORD_BYTES[s]. Checked for
    every warp and lane against the layouts as this JAX defines them."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    shape = (64, 16)
    assert fa.WGMMA_LAYOUT_8BIT.registers_shape(shape) == (1, 1, 1, 1, 2, 1, 1, 1, 1)
    assert fa.WGMMA_LAYOUT.registers_shape(shape) == (1, 2, 1, 1, 2, 1, 1, 1, 1)
    assert fa.WGMMA_LAYOUT.reduce([1]) == fa.WGMMA_ROW_LAYOUT
    for warp in range(4):
        for lane in range(32):
            row, t = 16 * warp + lane // 4, lane % 4
            for h in range(2):
                word = [_layout_element(fa.WGMMA_LAYOUT_8BIT, shape, warp, lane, (0, 0, 0, 0, h, 0, 0, 0, 0), b)
                        for b in range(4)]
                assert word == [(row + 8 * h, 4 * t + b) for b in range(4)]
                assert _layout_element(fa.WGMMA_ROW_LAYOUT, (64,), warp, lane, (0, 0, h, 0, 0), 0) == (row + 8 * h,)
                for c in range(2):
                    for v in range(2):
                        at, column = _layout_element(fa.WGMMA_LAYOUT, shape, warp, lane, (0, c, 0, 0, h, 0, 0, 0, 0),
                                                     v)
                        assert at == row + 8 * h
                        assert WORD_BYTES[column] == word[c + 2 * v][1]


def test_word_order_puts_each_input_where_the_word_decode_takes_it():
    """Piece slot s of a group's low / high piece holds byte WORD_BYTES[s]'s low / high nibble, input
    2 WORD_BYTES[s] (+1): `word_order` lays the activations out the same way; a permutation of each group."""
    k = 96
    order = np.asarray(word_order(jnp.arange(k)))
    for g in range(k // 32):
        got = order[32 * g:32 * (g + 1)] - 32 * g
        np.testing.assert_array_equal(got, np.concatenate([2 * WORD_BYTES, 2 * WORD_BYTES + 1]))
    assert sorted(order.tolist()) == list(range(k))
    assert np.asarray(k_order(jnp.arange(k), HopperMxfp4Blocks())).tolist() == np.asarray(even_odd(
        jnp.arange(k))).tolist()


def test_ptx_tables_hold_the_bf16_magnitudes():
    np.testing.assert_array_equal(decode_table_bits().astype(np.int64), _bf16_bits(np.abs(E2M1[:8])))


# ------------------------------------------------------------------------------------------------
# Lowering (any host) and refusals
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_lowers_for_cuda_on_any_host(form):
    blocks = FORMS[form]
    k, n = 1024, 128
    # 37 rows: the in-place forms pad them to whole 8-row tiles (the tiled copies need them)
    args = (jax.ShapeDtypeStruct((37, k), jnp.bfloat16), jax.ShapeDtypeStruct((4, n, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((4, k // 32, n), jnp.uint8), jax.ShapeDtypeStruct((4,), jnp.int32))

    def glu(x, p, s, sizes):
        return grouped_glu_hopper_mxfp4(x, Mxfp4Columns(p, s), Mxfp4Columns(p, s), sizes, blocks=blocks,
                                        interpret=False)

    module = jax.export.export(jax.jit(glu), platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in module
    # the PTX decode is in the kernel it lowers: the chunk decodes spread each chunk by prmt, the word decode shifts
    assert ("prmt.b32" in module) == (blocks.decode != "exact" and blocks.code_load == "pairs")
    assert ("shr.b32" in module) == (blocks.code_load == "words")
    assert ("mul.lo.u32" in module) == (blocks.decode in ("bits", "scaled"))
    assert ("0x7E807E80" in module) == (blocks.decode == "bits")      # "scaled" multiplies by the scale instead

    def pairs(x, p, s, group):
        return pair_glu_hopper_mxfp4(x, Mxfp4Columns(p, s), Mxfp4Columns(p, s), group, group >= 0, repeat=2,
                                     blocks=blocks, interpret=False)

    pair_args = (jax.ShapeDtypeStruct((3, k), jnp.bfloat16), *args[1:3], jax.ShapeDtypeStruct((6,), jnp.int32))
    assert "mosaic_gpu" in jax.export.export(jax.jit(pairs), platforms=["cuda"])(*pair_args).mlir_module()


@pytest.mark.parametrize("form", list(PERSISTENT))
def test_persistent_forms_lower_for_cuda_on_any_host(form, monkeypatch):
    """Interpret mode cannot run this launch (its accumulators pass through the item loop), so off the GPU the
    kernel is only lowered; `test_compiled_persistent_forms_equal_the_reference` runs it. Both projections
    must go through the persistent launch, not fall back to the grid one."""
    k, n = 1024, 256
    args = (jax.ShapeDtypeStruct((37, k), jnp.bfloat16), jax.ShapeDtypeStruct((4, n, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((4, k // 32, n), jnp.uint8), jax.ShapeDtypeStruct((4,), jnp.int32))
    launched = []

    def spy(sched, x, weights, *rest):
        launched.append(len(weights))
        return launch_persistent(sched, x, weights, *rest)

    monkeypatch.setattr(hopper_mxfp4, "launch_persistent", spy)
    for fn in (grouped_glu_hopper_mxfp4, grouped_matmul_hopper_mxfp4):
        fn.clear_cache()                                        # traced anew, so through the spy

    def mlp(x, p, s, sizes):
        h = grouped_glu_hopper_mxfp4(x, Mxfp4Columns(p, s), Mxfp4Columns(p, s), sizes, blocks=PERSISTENT[form],
                                     interpret=False)
        return grouped_matmul_hopper_mxfp4(h[:, :k // 4].repeat(4, axis=1), Mxfp4Columns(p, s), sizes,
                                           blocks=PERSISTENT[form], interpret=False)

    module = jax.export.export(jax.jit(mlp), platforms=["cuda"])(*args).mlir_module()
    assert module.count("mosaic_gpu") >= 2
    assert launched == [2, 1]                                   # gate and up together, then the down projection


def test_persistent_launch_refuses_what_it_cannot_run(rng):
    for bad, match in (({"activations": "rows"}, "activations='slab'"), ({"splits": 2}, "splits=1"),
                       ({"programs": -1}, "programs")):
        with pytest.raises(ValueError, match=match):
            HopperMxfp4Blocks(**({"launch": "persistent"} | bad))
    with pytest.raises(ValueError, match="launch"):
        HopperMxfp4Blocks(launch="cluster")
    w = to_columns(_weight(rng, 2, 256, 192))
    x, sizes = jnp.ones((4, 256), jnp.bfloat16), jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="N a multiple of 128, got N=192"):
        grouped_matmul_hopper_mxfp4(x, w, sizes, blocks=HopperMxfp4Blocks(launch="persistent"), interpret=False)
    with pytest.raises(ValueError, match="runs compiled only"):
        grouped_matmul_hopper_mxfp4(x, w, sizes, blocks=HopperMxfp4Blocks(launch="persistent", decode="exact"),
                                    interpret=True)


def test_settings_follow_the_rows_and_shared_memory():
    decode = HopperMxfp4Blocks.for_backend(False, 3584)
    assert (decode.rows, decode.outputs, decode.mma_inputs) == (8, "rows", 0)       # decode tiles: rows, one MMA
    assert decode.decode == "scaled" and HopperMxfp4Blocks.for_backend(False, 3584, decode="bits").decode == "bits"
    assert HopperMxfp4Blocks.for_backend(True, 3584).mma_inputs == 16                # interpret mode: per 16
    assert HopperMxfp4Blocks.for_backend(False, 3584, mma_inputs=32).mma_inputs == 32
    assert HopperMxfp4Blocks.for_backend(False, 3584, outputs="tiles").outputs == "tiles"
    wider = HopperMxfp4Blocks.for_backend(False, 3584, rows_per_group=20.5)
    assert (wider.rows, wider.outputs, wider.mma_inputs, wider.decode) == (24, "tiles", 16, "bits")
    prefill = HopperMxfp4Blocks.for_backend(False, 3584, rows_per_group=1170.0)       # 8K tokens x 16 / 112
    assert prefill.rows == 64 and prefill.outputs == "tiles" and prefill.smem_bytes(2) <= 227 * 1024
    assert HopperMxfp4Blocks.for_backend(False, 1152).block_k == 128                  # 1152 = 9 x 128
    assert HopperMxfp4Blocks.for_backend(False, 2304).block_k == 256                  # Kimi-Linear: 9 x 256
    assert HopperMxfp4Blocks.for_backend(True).decode == "exact"
    auto = HopperMxfp4Blocks(splits=0)      # the fewest splits giving 2 programs a multiprocessor (132)
    assert [auto.splits_for(p, s) for p, s in ((128, 9), (288, 4), (1024, 9), (1, 9), (100, 4))] == [3, 1, 1, 9, 4]
    assert HopperMxfp4Blocks(splits=2).splits_for(1, 9) == 2


def test_other_sides_run_the_dequantising_reference(rng, interpret):
    """Mxfp4Columns the kernel cannot tile (K = 96) still run through the op with impl "pallas": on the
    dequantised weights, as every non-kernel path."""
    wg, wu = _weight(rng, 2, 96, 64), _weight(rng, 2, 96, 64)
    assert not runs_here(96, 64) and runs_here(128, 64) == (jax.default_backend() != "gpu" or on_hopper())
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    sizes = jnp.asarray([2, 3], jnp.int32)
    out = grouped_glu(x, to_columns(wg), to_columns(wu), sizes, impl="pallas")
    ref = grouped_glu_reference(x, dequantize(wg, jnp.float32), dequantize(wu, jnp.float32), sizes)
    assert_close("fallback", out, ref, dtype="float32")


def on_hopper() -> bool:
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def test_refuses_what_it_cannot_run(rng):
    w = to_columns(_weight(rng, 2, 256, 64))
    x = jnp.ones((4, 256), jnp.bfloat16)
    sizes = jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="block_k=512"):
        grouped_matmul_hopper_mxfp4(x, w, sizes, blocks=HopperMxfp4Blocks(block_k=512, decode="exact",
                                                                           a_operand="smem"))
    with pytest.raises(ValueError, match="Mxfp4Columns"):
        grouped_matmul_hopper_mxfp4(x, Mxfp4Weight(w.packed, w.scale), sizes)
    with pytest.raises(ValueError, match=r"lhs \[M, 256\]"):
        grouped_matmul_hopper_mxfp4(x[:, :128], w, sizes)
    with pytest.raises(ValueError, match="N=32"):
        grouped_matmul_hopper_mxfp4(x, to_columns(_weight(rng, 2, 256, 32)), sizes)
    with pytest.raises(ValueError, match="splits=3 must divide the 2 steps"):
        grouped_matmul_hopper_mxfp4(x, w, sizes, blocks=HopperMxfp4Blocks(block_k=128, splits=3, decode="exact",
                                                                           a_operand="smem"))
    with pytest.raises(ValueError, match="shared memory"):
        grouped_matmul_hopper_mxfp4(x, w, sizes, blocks=HopperMxfp4Blocks(rows=256, block_k=256, stages=4,
                                                                           decode="exact"))
    for decode in ("ptx", "bits", "scaled"):          # inline PTX: compiled only
        with pytest.raises(ValueError, match=f"decode='{decode}' is inline PTX"):
            grouped_matmul_hopper_mxfp4(x, w, sizes, blocks=HopperMxfp4Blocks(decode=decode, a_operand="smem"),
                                        interpret=True)
    for bad in ({"rows": 12}, {"block_k": 96}, {"stages": 0}, {"decode": "table"}, {"a_operand": "tmem"},
                {"splits": -1}, {"mma_inputs": 64}, {"activations": "gather"},
                {"outputs": "scatter"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HopperMxfp4Blocks(**bad)
    with pytest.raises(ValueError, match="rows=256"):
        HopperMxfp4Blocks(rows=256, activations="rows")


# ------------------------------------------------------------------------------------------------
# Compiled (GPU)
# ------------------------------------------------------------------------------------------------

@on_gpu
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("sizes,m", [([3, 0, 5, 3], 12), ([0, 19, 1, 0], 26), ([1] * 4, 4)])
def test_compiled_forms_equal_the_reference(rng, form, sizes, m):
    g, k, f = len(sizes), 1024, 192
    blocks = FORMS[form]
    wg, wu = _weight(rng, g, k, f, _top_scale(blocks)), _weight(rng, g, k, f, _top_scale(blocks))
    x = jnp.asarray(rng.standard_normal((m, k)) * 0.05, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    dg, du = dequantize(wg, jnp.float32), dequantize(wu, jnp.float32)
    out = grouped_glu_hopper_mxfp4(x, to_columns(wg), to_columns(wu), group_sizes, blocks=blocks, interpret=False)
    assert_close("glu", out, grouped_glu_reference(x.astype(jnp.float32), dg, du, group_sizes), dtype=jnp.bfloat16)
    mm = grouped_matmul_hopper_mxfp4(x, to_columns(wg), group_sizes, blocks=blocks, interpret=False)
    assert_close("matmul", mm, grouped_matmul_reference(x.astype(jnp.float32), dg, group_sizes), dtype=jnp.bfloat16)


@on_gpu
@pytest.mark.parametrize("form", list(PERSISTENT))
@pytest.mark.parametrize("sizes,m", [([3, 0, 5, 3], 12), ([0, 19, 1, 0, 40, 7, 0, 30], 100), ([1] * 4, 4)])
def test_compiled_persistent_forms_equal_the_reference(rng, form, sizes, m):
    """N = 256 (two items a tile) and 384 (three); 100 rows over 8 experts: 14 tiles of 8 rows (9 of 16), so 28
    items for gate and up and 42 for the down projection, which the forms with 3, 5 or 7 programs walk several at
    a time (their accumulators cleared between items); with one program a multiprocessor each walks one."""
    g, k, f = len(sizes), 1024, 256
    blocks = PERSISTENT[form]
    wg, wu = _weight(rng, g, k, f, _top_scale(blocks)), _weight(rng, g, k, f, _top_scale(blocks))
    wd = _weight(rng, g, f, 384, _top_scale(blocks))
    x = jnp.asarray(rng.standard_normal((m, k)) * 0.05, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    dg, du, dd = (dequantize(w, jnp.float32) for w in (wg, wu, wd))
    h = grouped_glu_hopper_mxfp4(x, to_columns(wg), to_columns(wu), group_sizes, blocks=blocks, interpret=False)
    h_ref = grouped_glu_reference(x.astype(jnp.float32), dg, du, group_sizes)
    assert_close("glu", h, h_ref, dtype=jnp.bfloat16)
    hb = h_ref.astype(jnp.bfloat16)
    y = grouped_matmul_hopper_mxfp4(hb, to_columns(wd), group_sizes, blocks=blocks, interpret=False)
    assert_close("matmul", y, grouped_matmul_reference(hb.astype(jnp.float32), dd, group_sizes), dtype=jnp.bfloat16)


@on_gpu
@pytest.mark.parametrize("form", ["bits_registers", "ptx_registers", "scaled_registers", "exact_smem", "rows_in_place",
                                  "rows_in_place_out", "rows_out", "mma_step", "words_scaled_rows_out"])
def test_compiled_pairs_equal_the_reference(rng, form):
    """11 tokens: in place, the pairs of tokens 8-10 read their window from row 8."""
    g, k, f, tokens, repeat = 8, 1024, 128, 11, 4
    wg, wu = _weight(rng, g, k, f, _top_scale(FORMS[form])), _weight(rng, g, k, f, _top_scale(FORMS[form]))
    x = jnp.asarray(rng.standard_normal((tokens, k)) * 0.05, jnp.bfloat16)
    group = jnp.asarray(rng.integers(0, g, tokens * repeat), jnp.int32)
    valid = jnp.asarray(rng.uniform(size=tokens * repeat) < 0.8)
    dg, du = dequantize(wg, jnp.float32), dequantize(wu, jnp.float32)
    h = pair_glu_hopper_mxfp4(x, to_columns(wg), to_columns(wu), group, valid, repeat=repeat, blocks=FORMS[form],
                              interpret=False)
    ref = pair_glu_reference(x.astype(jnp.float32), dg, du, group, valid, repeat=repeat)
    assert_close("pair glu", h, ref, dtype=jnp.bfloat16)
