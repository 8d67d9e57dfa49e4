"""E2M1 decode of packed bytes in PTX, four bytes per instance (the compiled MXFP4 kernels only).

`decode_e2m1_asm(packed)` gives the same values as `mxfp4.decode_e2m1_raw` (each code's value times
2^-126 as fp32: codes +-0.5 become subnormals) for both nibbles of every byte, but works on the four
bytes of one 32-bit register at once: no byte is extracted first, and each value costs three integer
instructions (a left shift that puts the nibble's sign on bit 31, an arithmetic right shift by 6 that
lands the exponent and mantissa bits on fp32 bits 22-24, one AND). Inline assembly runs only in a
compiled kernel; `mxfp4.decode_e2m1_raw` and `mxfp4.decode_e2m1` are its twins (interpret mode, CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

_KEEP = "0x81C00000"     # fp32 sign bit, exponent bits 23-24, mantissa bit 22


def _nibble(out: int, shift: int) -> str:
    """PTX for one value: the nibble whose sign bit is bit (31 - shift) of the input word ($4)."""
    src = "$4"
    lines = []
    if shift:
        lines.append(f"shl.b32 t, $4, {shift};")
        src = "t"
    lines.append(f"shr.s32 t, {src}, 6;")
    lines.append(f"and.b32 ${out}, t, {_KEEP};")
    return " ".join(lines)


# Outputs $0-$3 from the word $4 of bytes 0-3: their low nibbles (sign bits 3, 11, 19, 27) or their high
# nibbles (sign bits 7, 15, 23, 31). Two instances, one per nibble: a Pallas inline-assembly call has one result.
_ASM = {high: "{ .reg .b32 t; " + " ".join(_nibble(i, (24 if high else 28) - 8 * i) for i in range(4)) + " }"
        for high in (False, True)}


def _factor(out: int) -> str:
    """PTX for one scale: byte `out` of the input word ($4) zero-extended, at most 193, then placed in the
    exponent field plus 62: 2^(s - 65) (and inf from s = 193 on)."""
    return (f"prmt.b32 t, $4, 0, 0x444{out}; min.u32 t, t, 193; "
            f"mad.lo.u32 ${out}, t, 8388608, {62 << 23};")


_FACTOR_ASM = "{ .reg .b32 t; " + " ".join(_factor(i) for i in range(4)) + " }"


def _bf16_pairs(high: bool) -> str:
    """PTX: bytes 0-3 of $2 -> the bf16 pairs (byte 0, byte 1) in $0 and (byte 2, byte 3) in $1 of one nibble.
    A byte permute spreads two bytes to the low byte of each 16-bit half; then the nibble's exponent
    and mantissa bits go to bf16 bits 6-8 and its sign to bit 15 of each half at once."""
    body, sign = (2, 8) if high else (6, 12)
    lines = []
    for out, select in ((0, "0x4140"), (1, "0x4342")):
        lines.append(f"prmt.b32 x, $2, 0, {select}; shl.b32 m, x, {body}; shl.b32 x, x, {sign}; "
                     f"and.b32 m, m, 0x01C001C0; and.b32 x, x, 0x80008000; or.b32 ${out}, m, x;")
    return "{ .reg .b32 x, m; " + " ".join(lines) + " }"


_BF16_ASM = {high: _bf16_pairs(high) for high in (False, True)}


def decode_e2m1_bf16_asm(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """packed uint8 [...] -> (low nibble, high nibble) values x 2^-126 as bf16 [...] each (codes +-0.5
    bf16 subnormals): two values per instruction sequence, for a tensor-core product."""
    return tuple(_per_word(_BF16_ASM[high], packed, jnp.bfloat16, "decode_e2m1_bf16_asm") for high in (False, True))


def raw_scale_factor_asm(scale: jax.Array) -> jax.Array:
    """E8M0 bytes uint8 [...] -> fp32 2^(s - 1 - RAW_SCALE_OFFSET) [...], `mxfp4.raw_scale_factor` in three
    instructions per byte. It differs below s = 66, where the twin gives 0 and this gives the tiny factor
    itself (a group whose weights are all below 2^-59: its scaled sum may land on fp32 subnormals and lose
    precision instead of reading as 0)."""
    return _per_word(_FACTOR_ASM, scale, jnp.float32, "raw_scale_factor_asm")


def decode_e2m1_asm(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """packed uint8 [...] -> (low nibble, high nibble) values x 2^-126 as fp32 [...] each."""
    return tuple(_per_word(_ASM[high], packed, jnp.float32, "decode_e2m1_asm") for high in (False, True))


def _per_word(asm: str, data: jax.Array, dtype, name: str) -> jax.Array:
    """`asm` on each 32-bit register of four uint8 values of `data`, giving `dtype` [...] (four values, in
    as many registers as they fill)."""
    if data.dtype != jnp.uint8:
        raise ValueError(f"{name}: the bytes must be uint8, got {data.dtype}")
    registers = jnp.dtype(dtype).itemsize           # four values of `dtype` in 32-bit registers
    return plt.elementwise_inline_asm(asm, args=[data], constraints=",".join(["=r"] * registers + ["r"]), pack=4,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(data.shape, dtype)])[0]
