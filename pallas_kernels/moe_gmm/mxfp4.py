"""MXFP4 expert weights kept packed on the device (the format of K3's routed experts).

`Mxfp4Weight` holds a stack of matrices W [G, K, N] (used as x @ W[g]) as
  packed uint8 [G, K/2, N]: row j holds inputs 2j (low nibble) and 2j + 1 (high nibble), E2M1 codes
                            (bit 3 the sign, bits 0-2 index [0, 0.5, 1, 1.5, 2, 3, 4, 6]);
  scale  uint8 [G, K/32, N]: E8M0, a factor 2^(s - 127) per 32 consecutive inputs.
This is the checkpoint's `weight_packed` [N, K/2] / `weight_scale` [N, K/32] per expert, transposed
(`from_checkpoint_layout`), so a kernel streams it with the same [K, N] tiles as a bf16 weight and a
quarter of the bytes. Every value is exact in bf16.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

GROUP = 32                      # inputs per scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4Weight(NamedTuple):
    packed: jax.Array           # uint8 [G, K/2, N]
    scale: jax.Array            # uint8 [G, K/32, N]

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical [G, K, N]."""
        g, half, n = self.packed.shape
        return g, 2 * half, n

    @property
    def ndim(self) -> int:
        return 3


def validate(w: Mxfp4Weight) -> None:
    g, k, n = w.shape
    if w.packed.dtype != jnp.uint8 or w.scale.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 weight: packed and scale must be uint8, got {w.packed.dtype} and {w.scale.dtype}")
    if w.packed.ndim != 3 or k % GROUP or w.scale.shape != (g, k // GROUP, n):
        raise ValueError(f"MXFP4 weight: packed [G, K/2, N] with K a multiple of {GROUP} and scale [G, K/32, N]; got "
                         f"{w.packed.shape} and {w.scale.shape}")


def from_checkpoint_layout(packed_gnk, scale_gnk) -> Mxfp4Weight:
    """Stacked checkpoint tensors, packed uint8 [G, N, K/2] and scale uint8 [G, N, K/32] (out x in,
    as stored per expert), -> Mxfp4Weight in the [K, N] layout the kernels read."""
    w = Mxfp4Weight(jnp.swapaxes(packed_gnk, 1, 2), jnp.swapaxes(scale_gnk, 1, 2))
    validate(w)
    return w


def dequantize(w: Mxfp4Weight, dtype=jnp.bfloat16) -> jax.Array:
    """[G, K, N] in `dtype` (the reference: a table lookup and an exact power-of-two scale)."""
    validate(w)
    g, k, n = w.shape
    table = jnp.asarray(E2M1, jnp.float32)
    codes = jnp.stack([w.packed & 0x0F, w.packed >> 4], axis=2).reshape(g, k, n)      # input 2j, then 2j + 1
    factors = jnp.ldexp(jnp.float32(1.0), w.scale.astype(jnp.int32) - 127)             # [G, K/32, N]
    return (table[codes] * jnp.repeat(factors, GROUP, axis=1)).astype(dtype)


_TWICE_MAGNITUDE = -932957680  # 0xC8643210 as int32: nibble i holds 2 x |E2M1 code i| (0, 1, 2, 3, 4, 6, 8, 12)
_HALF_ULP_BASE = 0x4A800000     # the bits of 2^22, whose mantissa steps are 0.5


def decode_e2m1(codes):
    """E2M1 codes -> fp32 values with integer ops and no conversion instruction (the kernels' form).

    Only bits 0-3 of `codes` (int32) are read, so a whole packed byte decodes its low nibble. Twice
    the magnitude is a 4-bit entry of one int32 table; placed in the mantissa of 2^22 it becomes
    2^22 + magnitude exactly, and subtracting 2^22 leaves the magnitude; the sign bit is XORed in."""
    twice = (jnp.int32(_TWICE_MAGNITUDE) >> ((codes & 7) << 2)) & 15
    magnitude = jax.lax.bitcast_convert_type(twice | _HALF_ULP_BASE, jnp.float32) - 4194304.0
    signed = jax.lax.bitcast_convert_type(magnitude, jnp.int32) ^ ((codes & 8) << 28)
    return jax.lax.bitcast_convert_type(signed, jnp.float32)


_SIGN_BIT = -2147483648          # 0x80000000 as int32
_MAGNITUDE_BITS = 0x01C00000     # fp32 exponent bits 23-24 and mantissa bit 22
RAW_SCALE_OFFSET = 64            # `raw_scale_factor` leaves 2^64 to multiply in (the kernels: on the activations)


def decode_e2m1_raw(codes, high: bool):
    """One nibble of packed bytes (int32) -> its E2M1 value times 2^-126 in fp32, in three integer
    ops: the code's exponent and mantissa bits land on fp32's lowest exponent bits and top mantissa
    bit, where codes +-0.5 become subnormals (exact unless the device flushes them)."""
    body, sign = (18, 24) if high else (22, 28)
    bits = ((codes << body) & _MAGNITUDE_BITS) | ((codes << sign) & _SIGN_BIT)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def raw_scale_factor(scale):
    """E8M0 bytes -> 2^(s - 1 - RAW_SCALE_OFFSET), the factor a `decode_e2m1_raw` value takes so that
    value x factor x 2^RAW_SCALE_OFFSET is the weight (the kernels put the 2^RAW_SCALE_OFFSET on the
    activations and this factor on each scale group's sum). Exact for s in [66, 192] (weights between
    2^-61 and 2^65); smaller scales read as 0, larger ones as inf (visible)."""
    field = scale.astype(jnp.int32) + 126 - RAW_SCALE_OFFSET
    field = jnp.where(scale.astype(jnp.int32) < RAW_SCALE_OFFSET + 2, 0, jnp.minimum(field, 255))
    return jax.lax.bitcast_convert_type(field << 23, jnp.float32)


def scale_factor(scale):
    """E8M0 bytes -> 2^(s - 127) in fp32 by placing s in the exponent field (exact for s >= 1;
    s = 0, 2^-127, becomes 0: a group whose largest weight is below 1e-37)."""
    return jax.lax.bitcast_convert_type(scale.astype(jnp.int32) << 23, jnp.float32)


def split_even_odd(lhs):
    """[M, K] -> ([M, K/2] inputs 0, 2, 4, .., [M, K/2] inputs 1, 3, 5, ..): the activations each
    nibble of a packed row multiplies."""
    return lhs[:, 0::2], lhs[:, 1::2]
