"""Absorbed MLA decode attention over a latent cache (flash-decoding, split over the sequence)."""

from pallas_kernels.mla_decode.kernel import mla_decode_pallas
from pallas_kernels.mla_decode.reference import mla_decode_reference, validate_inputs
from pallas_kernels.mla_decode.tuning import MLADecodeBlocks

__all__ = ["mla_decode_pallas", "mla_decode_reference", "validate_inputs", "MLADecodeBlocks"]
