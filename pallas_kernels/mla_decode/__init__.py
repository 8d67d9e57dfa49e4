"""Absorbed MLA decode attention over a latent cache (flash-decoding, split over the sequence)."""

from pallas_kernels.mla_decode.ops import MLA_DECODE_IMPLS, mla_decode
from pallas_kernels.mla_decode.reference import mla_decode_reference
from pallas_kernels.mla_decode.tuning import MLADecodeBlocks

__all__ = ["MLA_DECODE_IMPLS", "mla_decode", "mla_decode_reference", "MLADecodeBlocks"]
