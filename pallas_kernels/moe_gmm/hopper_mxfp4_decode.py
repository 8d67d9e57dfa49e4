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
PTX_DECODE_BITS = """
{
.reg .b32 pair, low, high, unit, zero;
prmt.b32 pair, $2, 0, 0x4140;
and.b32 low, pair, 0x000F000F;
and.b32 high, pair, 0x00F000F0;
mul.lo.u32 low, low, 0x1040;
mul.lo.u32 high, high, 0x0104;
and.b32 low, low, 0x81C081C0;
and.b32 high, high, 0x81C081C0;
mov.b32 unit, 0x7E807E80;
mov.b32 zero, 0x80008000;
fma.rn.bf16x2 $0, low, unit, zero;
fma.rn.bf16x2 $1, high, unit, zero;
}
"""

# "scaled": the "bits" decode with the group's scale in its multiply. In place of 2^126 each pair is multiplied by
# $3, the bf16 pair (2^126 x scale, 2^126 x scale) = 2^(s - 1) for E8M0 s (bits (s + 126) << 7): exact for
# s <= 128, the range bf16 holds, and one multiply per pair where "bits" and the kernel's scale took two.
PTX_DECODE_SCALED = """
{
.reg .b32 pair, low, high, zero;
prmt.b32 pair, $2, 0, 0x4140;
and.b32 low, pair, 0x000F000F;
and.b32 high, pair, 0x00F000F0;
mul.lo.u32 low, low, 0x1040;
mul.lo.u32 high, high, 0x0104;
and.b32 low, low, 0x81C081C0;
and.b32 high, high, 0x81C081C0;
mov.b32 zero, 0x80008000;
fma.rn.bf16x2 $0, low, $3, zero;
fma.rn.bf16x2 $1, high, $3, zero;
}
"""
# The largest E8M0 scale byte the "scaled" decode takes: 2^(128 - 127) = 2, weights up to 12 in magnitude.
SCALED_MAX_SCALE = 128


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


DECODERS = {"exact": decode_exact, "ptx": decode_ptx,
             "bits": functools.partial(decode_ptx, text=PTX_DECODE_BITS)}
