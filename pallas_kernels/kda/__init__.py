"""Kimi Delta Attention (gated delta rule with per-channel decay)."""

from pallas_kernels.kda.ops import KDA_IMPLS, kda, kda_decode
from pallas_kernels.kda.reference import (kda_chunk_reference, kda_decode_reference, kda_recurrent_reference,
                                          validate_inputs)

__all__ = ["KDA_IMPLS", "kda", "kda_decode", "kda_chunk_reference", "kda_decode_reference",
           "kda_recurrent_reference", "validate_inputs"]
