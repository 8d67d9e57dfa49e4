"""Kimi Delta Attention (gated delta rule with per-channel decay): the reference, the pure-JAX
forms, the Pallas kernels and the one dispatch site (`ops`)."""

from pallas_kernels.kda.chunk import kda_chunk_pallas
from pallas_kernels.kda.chunk_xla import kda_chunk_xla
from pallas_kernels.kda.decode import kda_decode_pallas, kda_decode_steps_pallas
from pallas_kernels.kda.decode_hopper import (HopperDecodeBlocks, hopper_decode_runs_here,
                                             kda_decode_hopper)
from pallas_kernels.kda.decode_steps import kda_decode_steps, kda_verify_outputs
from pallas_kernels.kda.decode_xla import kda_decode_xla
from pallas_kernels.kda.gate import forget_gate, gated_rms_norm, l2_normalize, softplus
from pallas_kernels.kda.ops import (KDA_DECODE_IMPLS, KDA_IMPLS, KDA_VARLEN_IMPLS, KDADecodeImpl, KDAImpl, KDAVarlenImpl,
                                    kda, kda_decode, kda_varlen)
from pallas_kernels.kda.params import KDADecodeInputs, KDADecodeWeights
from pallas_kernels.kda.reference import kda_recurrent_reference, kda_varlen_reference, validate_inputs
from pallas_kernels.kda.tuning import ChunkBlocks, DecodeBlocks, value_blocks_fit
from pallas_kernels.kda.varlen import kda_varlen_pallas

__all__ = [
    # Ops (dispatch by implementation name)
    "kda", "kda_varlen", "kda_decode", "kda_decode_steps", "kda_verify_outputs", "KDAImpl", "KDA_IMPLS",
    "KDAVarlenImpl", "KDA_VARLEN_IMPLS", "KDADecodeImpl", "KDA_DECODE_IMPLS",
    # Arguments and launch settings
    "KDADecodeInputs", "KDADecodeWeights", "ChunkBlocks", "DecodeBlocks", "HopperDecodeBlocks",
    "value_blocks_fit", "hopper_decode_runs_here",
    # Implementations
    "kda_recurrent_reference", "kda_varlen_reference", "kda_chunk_xla", "kda_chunk_pallas", "kda_varlen_pallas", "kda_decode_xla", "kda_decode_pallas",
    "kda_decode_hopper", "kda_decode_steps_pallas",
    # Shared scalar math and validation
    "forget_gate", "gated_rms_norm", "l2_normalize", "softplus", "validate_inputs",
]
