"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`) routed-expert weights (arch §8.4).

A weight W [out, in] is stored as weight_packed uint8 [out, in/2] (two E2M1 codes per byte, LOW
nibble = even element) and weight_scale uint8 [out, in/32] (E8M0: 2^(s - 127) per 32 inputs).
E2M1 is sign-magnitude: bit 3 the sign, bits 0-2 index [0, 0.5, 1, 1.5, 2, 3, 4, 6].
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.moe_gmm.mxfp4 import E2M1, GROUP

E2M1_VALUES = np.asarray(E2M1, np.float32)  # index = 4-bit code (the table the kernels' reference uses)


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """packed uint8 [O, I/2], scale uint8 [O, I/32] -> fp32 [O, I] (exact)."""
    if packed.dtype != np.uint8 or scale.dtype != np.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scale.dtype}")
    o, half = packed.shape
    if scale.shape != (o, 2 * half // GROUP) or (2 * half) % GROUP:
        raise ValueError(f"MXFP4 scale shape {scale.shape} does not fit packed shape {packed.shape}")
    if (scale == 255).any():
        raise ValueError("MXFP4 scale holds 255 (E8M0 NaN)")
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(o, 2 * half)
    values = E2M1_VALUES[codes]
    factors = np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127).astype(np.float32)
    return values * np.repeat(factors, GROUP, axis=1)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [O, I] -> (packed uint8 [O, I/2], scale uint8 [O, I/32]); round to nearest E2M1 code
    with a per-group power-of-two scale (largest magnitude maps into [4, 8))."""
    w = np.asarray(w, np.float32)
    o, i = w.shape
    if i % GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {GROUP}, got {i}")
    groups = w.reshape(o, i // GROUP, GROUP)
    amax = np.abs(groups).max(axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-38))) - 2, -127).astype(np.int32)
    exp = np.clip(exp, -127, 127)
    scaled = groups / np.ldexp(np.float32(1.0), exp)[..., None]
    codes = np.abs(scaled[..., None] - E2M1_VALUES).argmin(axis=-1).astype(np.uint8).reshape(o, i)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, (exp + 127).astype(np.uint8)
