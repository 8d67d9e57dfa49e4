"""E2M1 decodes for the Hopper MXFP4 kernels: packed codes [64, C] uint8 in the WGMMA register layout
-> (low nibbles, high nibbles) as bf16 [64, C] in the same layout (`hopper_mxfp4`'s docstring compares them).

`DECODERS` maps each `HopperMxfp4Blocks.decode` name to its function: "exact" (integer ops, runs in interpret
mode too), "ptx" (byte tables read by `prmt`) and "bits" (bits placed where a bf16 holds them, one exact
multiply); the last two are inline PTX and run compiled only. "scaled" (`decode_scaled`) is "bits" with the
group's scale folded into that multiply, so it takes the scales too (E8M0 bytes up to `SCALED_MAX_SCALE`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu


def decode_exact(codes):
    """E2M1 codes of both nibbles to exact bf16 with integer ops: the magnitude in halves is
    (2 + mantissa) << (exponent - 1) for exponents >= 1 and the code itself below (0 or 1)."""
    c = codes.astype(jnp.int32)

    def one(nibble):
        m = nibble & 7
        halves = jnp.where(m < 2, m, (2 + (m & 1)) << jnp.maximum((m >> 1) - 1, 0))
        half = jnp.where((nibble & 8) != 0, -0.5, 0.5)
        return (halves.astype(jnp.float32) * half).astype(jnp.bfloat16)

    return one(c & 15), one(c >> 4)


# bf16 bits of the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: low bytes and high bytes, each an
# 8-entry byte table in two registers (entries 0-3, then 4-7) for `prmt`.
LOW_BYTES = (0xC0800000, 0xC0804000)
HIGH_BYTES = (0x3F3F3F00, 0x40404040)

# One 16-bit chunk [byte0, byte1] of codes (byte j: low nibble input 2j, high nibble 2j + 1) -> $0 the
# bf16 pair of the low nibbles, $1 the pair of the high nibbles. The selector's nibbles are the
# chunk's four codes with the sign bits cleared (prmt reads 4 selector nibbles, each a byte index
# 0-7); two table reads give the low and the high bytes of all four values, two permutes pair them;
# the sign bits (3 and 7 of each byte) are moved to bits 15 and 31 and ORed in.
PTX_DECODE = f"""
{{
.reg .b32 sel, lo_bytes, hi_bytes, low_pair, high_pair, spread, spread_lo;
and.b32 sel, $2, 0x7777;
prmt.b32 lo_bytes, {LOW_BYTES[0]:#x}, {LOW_BYTES[1]:#x}, sel;
prmt.b32 hi_bytes, {HIGH_BYTES[0]:#x}, {HIGH_BYTES[1]:#x}, sel;
prmt.b32 low_pair, lo_bytes, hi_bytes, 0x6240;
prmt.b32 high_pair, lo_bytes, hi_bytes, 0x7351;
prmt.b32 spread, $2, 0, 0x1404;
shl.b32 spread_lo, spread, 4;
lop3.b32 $0, low_pair, spread_lo, 0x80008000, 0xF8;
lop3.b32 $1, high_pair, spread, 0x80008000, 0xF8;
}}
"""

# The same chunk -> the same two bf16 pairs by placing bits ("bits"). A code s e1 e0 m whose magnitude bits
# e1 e0 m sit in bits 8-6 of a bf16 and its sign in bit 15 is the code's value times 2^-126 (exponent
# field e1 e0; for e1 e0 = 0 a subnormal, 0 or 0.5 x 2^-126), so one exact multiply by 2^126 gives the
# value. The pair's two bytes are spread to bits 0-7 and 16-23; each nibble, masked, is copied to two places
# by one integer multiply (x (2^6 + 2^12) for the low nibbles, x (2^2 + 2^8) for the high ones: the copies
# do not overlap, so no carries), and a mask keeps the magnitude from the first copy and the sign from
# the second. Five instructions on the integer ALU (prmt, four and) where the tables take eight:
# the multiplies issue to the multiply-add pipe, as do the two bf16 multiplies. Their addend is -0.0, so that
# code 8 (-0) stays -0: (+0) + (-0) would round to +0.
def chunk_ptx(scaled: bool) -> str:
    """The bits decode of one 16-bit chunk: times 2^126 ("bits"), or (`scaled`) times $3, the bf16 pair
    (2^126 x scale, 2^126 x scale) = 2^(s - 1) for E8M0 s (bits (s + 126) << 7): exact for s <= 128, the range
    bf16 holds, and one multiply per pair where "bits" and the kernel's scale take two ("scaled")."""
    factor = "$3" if scaled else "unit"
    return f"""
{{
.reg .b32 pair, low, high, {'' if scaled else 'unit, '}zero;
prmt.b32 pair, $2, 0, 0x4140;
and.b32 low, pair, 0x000F000F;
and.b32 high, pair, 0x00F000F0;
mul.lo.u32 low, low, 0x1040;
mul.lo.u32 high, high, 0x0104;
and.b32 low, low, 0x81C081C0;
and.b32 high, high, 0x81C081C0;
{'' if scaled else 'mov.b32 unit, 0x7E807E80;' + chr(10)}mov.b32 zero, 0x80008000;
fma.rn.bf16x2 $0, low, {factor}, zero;
fma.rn.bf16x2 $1, high, {factor}, zero;
}}
"""


PTX_DECODE_BITS = chunk_ptx(scaled=False)
PTX_DECODE_SCALED = chunk_ptx(scaled=True)
# The largest E8M0 scale byte the "scaled" decode takes: 2^(128 - 127) = 2, weights up to 12 in magnitude.
SCALED_MAX_SCALE = 128


def scaled_factor_bits(scale):
    """E8M0 scale bytes (uint8, a Mosaic GPU array or a jnp one) -> int16 bf16 bits of 2^126 x 2^(s - 127) =
    2^(s - 1), the "scaled" decode's multiplier: exponent field s + 126, saturated at 255 (inf) past
    SCALED_MAX_SCALE, so that larger scales come out inf or NaN instead of wrapping into the sign bit."""
    return jnp.minimum(scale.astype(jnp.int16) + 126, 255) << 7


def scaled_pair_bits(scale):
    """The same as a uint32 bf16 pair (both halves 2^(s - 1)), as the word decode takes it: one multiply places
    the exponent field s + 126 in bits 7-14 and 23-30."""
    return (jnp.minimum(scale.astype(jnp.uint32), SCALED_MAX_SCALE + 1) + 126) * 0x00800080


def word_ptx(scaled: bool) -> str:
    """The bits decode on a whole 32-bit word of four code bytes [b0 b1 b2 b3] (`HopperMxfp4Blocks.code_load=
    "words"`) -> $0 the bf16 pair of b0's and b2's low nibbles, $1 of b1's and b3's, $2 and $3 the same of the high
    nibbles, each times $5 (`scaled`: the row's 2^(s - 1) pair) or 2^126. The pairs (b0, b2) sit in bits 0-7 and
    16-23 already, so no `prmt` spreads them: b0's nibbles are copied by one multiply as in the chunk decode, and
    b1's and b3's are first shifted down (by 2 for the low nibbles, by 6 for the high ones) to where the masked
    nibble times 65 leaves the magnitude in bits 6-8 and the sign in bit 15. Per eight codes two shifts, eight
    `and`, four integer multiplies and four bf16 multiplies: as many as two chunk decodes (whose two `prmt` the two
    shifts replace). What the word form saves is half the code loads (one 32-bit load per eight codes), and with
    `scaled` the pair multiplier built by one integer multiply."""
    factor = "$5" if scaled else "unit"
    return f"""
{{
.reg .b32 a, b, c, d, v, u, zero{'' if scaled else ', unit'};
mov.b32 zero, 0x80008000;
{'' if scaled else 'mov.b32 unit, 0x7E807E80;'}
and.b32 a, $4, 0x000F000F;
and.b32 b, $4, 0x00F000F0;
shr.b32 v, $4, 2;
shr.b32 u, $4, 6;
and.b32 c, v, 0x03C003C0;
and.b32 d, u, 0x03C003C0;
mul.lo.u32 a, a, 0x1040;
mul.lo.u32 b, b, 0x0104;
mul.lo.u32 c, c, 0x41;
mul.lo.u32 d, d, 0x41;
and.b32 a, a, 0x81C081C0;
and.b32 b, b, 0x81C081C0;
and.b32 c, c, 0x81C081C0;
and.b32 d, d, 0x81C081C0;
fma.rn.bf16x2 $0, a, {factor}, zero;
fma.rn.bf16x2 $1, c, {factor}, zero;
fma.rn.bf16x2 $2, b, {factor}, zero;
fma.rn.bf16x2 $3, d, {factor}, zero;
}}
"""


PTX_DECODE_WORD = word_ptx(scaled=False)
PTX_DECODE_WORD_SCALED = word_ptx(scaled=True)
# A scale group's 16 code bytes in the order the word decode's pieces take them (`decode_words`): piece slot s of
# thread quad t (slots 2t, 2t + 1 and 2t + 8, 2t + 9) holds byte 4t + s // 8 + 2 (s % 2), so the low-nibble piece
# is the even bytes' low nibbles then the odd bytes'; with the activations in `word_order`.
WORD_BYTES = np.concatenate([np.arange(0, 16, 2), np.arange(1, 16, 2)])


def decode_table_bits() -> np.ndarray:
    """The bf16 bit patterns the PTX tables hold for magnitude codes 0-7 (checked against
    `mxfp4.E2M1` by the tests, since the PTX itself runs only on a GPU)."""
    low = np.array(LOW_BYTES, np.uint32).view(np.uint8)
    high = np.array(HIGH_BYTES, np.uint32).view(np.uint8)
    return (high.astype(np.uint16) << 8) | low


def decode_ptx(codes, text: str = PTX_DECODE, factor=None):
    """`text` (`PTX_DECODE` or `PTX_DECODE_BITS`; with `factor`, `PTX_DECODE_SCALED`) on every register of
    `codes` (WGMMA layout: two bytes per register, columns 2c and 2c + 1 of a row); `factor`: bf16 [64, C] in the
    same layout, each register the pair its codes are multiplied by. The outputs keep the registers' places, so
    they are in the WGMMA layout too."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental import mosaic as _  # noqa: F401  (registers the dialects)
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    out_type = plgpu.ShapeDtypeStruct(codes.shape, jnp.bfloat16, plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * (1 if factor is None else 2),
                       return_type=(out_type, out_type))
    def decode(_, array, *scale):
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        two_i32 = llvm.StructType.get_literal([i32, i32])
        low, high = np.empty_like(array.registers), np.empty_like(array.registers)
        if scale and scale[0].registers.shape != array.registers.shape:
            raise ValueError(f"MXFP4 decode: factor registers {scale[0].registers.shape} do not match the codes' "
                             f"{array.registers.shape}")
        for idx, reg in np.ndenumerate(array.registers):
            chunk = arith.extui(i32, mgpu_utils.bitcast(reg, i16))
            if scale:
                both = llvm.inline_asm(two_i32, [chunk, mgpu_utils.bitcast(scale[0].registers[idx], i32)], text,
                                       "=r,=r,r,r")
            else:
                both = llvm.inline_asm(two_i32, [chunk], text, "=r,=r,r")
            low[idx] = mgpu_utils.bitcast(llvm.extractvalue(i32, both, [0]), pair)
            high[idx] = mgpu_utils.bitcast(llvm.extractvalue(i32, both, [1]), pair)
        return (fa.FragmentedArray(_registers=low, _layout=array.layout, _is_signed=None),
                fa.FragmentedArray(_registers=high, _layout=array.layout, _is_signed=None))

    return decode(codes) if factor is None else decode(codes, factor)


def decode_scaled(codes, factor):
    """`PTX_DECODE_SCALED` on `codes` with `factor` (bf16 [64, C], WGMMA layout: 2^(s - 1) per row for the
    group's E8M0 scale s <= SCALED_MAX_SCALE) -> (low nibbles, high nibbles) already scaled."""
    return decode_ptx(codes, PTX_DECODE_SCALED, factor)


def decode_words(codes, factor=None):
    """The word decode (`word_ptx`) on `codes` u8 [64, 16] (one scale group) in Mosaic GPU's WGMMA_8BIT layout (each
    thread four consecutive bytes of its two rows), with `factor` u32 [64] in the WGMMA row layout (per row the
    bf16 pair 2^(s - 1): the "scaled" decode) or None (times 2^126: the bits decode, scale still to apply) ->
    (the low nibbles' piece, the high nibbles' piece), bf16 [64, 16] each in the WGMMA layout, their columns the
    bytes in `WORD_BYTES` order. Thread registers: codes [h] (row r + 8h) -> pieces [c, h] (columns 8c + 2t..)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental import mosaic as _  # noqa: F401  (registers the dialects)
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    if codes.shape != (64, 16):
        raise ValueError(f"MXFP4 word decode: one scale group's codes [64, 16] at a time, got {codes.shape}")
    out_type = plgpu.ShapeDtypeStruct(codes.shape, jnp.bfloat16, plgpu.Layout.WGMMA)
    text = PTX_DECODE_WORD if factor is None else PTX_DECODE_WORD_SCALED

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,) + (() if factor is None else
                                                              (plgpu.Layout.WGMMA.reduce(1),)),
                       return_type=(out_type, out_type))
    def decode(_, array, *scale):
        i32 = ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        four_i32 = llvm.StructType.get_literal([i32] * 4)
        shape = fa.WGMMA_LAYOUT.registers_shape(codes.shape)           # [.., c, .., h, ..]: (1, 2, 1, 1, 2, ...)
        if array.registers.shape != fa.WGMMA_LAYOUT_8BIT.registers_shape(codes.shape) or shape[1] != 2:
            raise ValueError(f"MXFP4 word decode: unexpected registers {array.registers.shape} / {shape}")
        low, high = np.empty(shape, object), np.empty(shape, object)
        for h in range(2):
            word = mgpu_utils.bitcast(array.registers[0, 0, 0, 0, h, 0, 0, 0, 0], i32)
            args = [word] + ([mgpu_utils.bitcast(scale[0].registers[0, 0, h, 0, 0], i32)] if scale else [])
            out = llvm.inline_asm(four_i32, args, text, "=r,=r,=r,=r,r" + (",r" if scale else ""))
            for c in range(2):
                at = (0, c, 0, 0, h, 0, 0, 0, 0)
                low[at] = mgpu_utils.bitcast(llvm.extractvalue(i32, out, [c]), pair)
                high[at] = mgpu_utils.bitcast(llvm.extractvalue(i32, out, [2 + c]), pair)
        return (fa.FragmentedArray(_registers=low, _layout=fa.WGMMA_LAYOUT, _is_signed=None),
                fa.FragmentedArray(_registers=high, _layout=fa.WGMMA_LAYOUT, _is_signed=None))

    return decode(codes) if factor is None else decode(codes, factor)


def decode_words_exact(codes):
    """The word decode's pieces in interpret mode (or anywhere jnp runs): `decode_exact` on the group's bytes in
    `WORD_BYTES` order (its even bytes, then its odd ones; a reshape, not a gather, which a kernel cannot close
    over)."""
    rows, width = codes.shape
    return decode_exact(codes.reshape(rows, width // 2, 2).swapaxes(1, 2).reshape(rows, width))


DECODERS = {"exact": decode_exact, "ptx": decode_ptx,
             "bits": functools.partial(decode_ptx, text=PTX_DECODE_BITS)}
