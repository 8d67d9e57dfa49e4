"""RMSNorm of a few rows in one launch (decode), alone or with the residual add before it, with
their XLA twins."""

from pallas_kernels.rms_norm.kernel import add_rms_norm_pallas, rms_norm_pallas
from pallas_kernels.rms_norm.ops import NORM_IMPLS, NormImpl, add_rms_norm, resolve_norm_impl, rms_norm
from pallas_kernels.rms_norm.reference import add_rms_norm_reference, rms_norm_reference

__all__ = ["rms_norm", "rms_norm_pallas", "rms_norm_reference", "add_rms_norm", "add_rms_norm_pallas",
           "add_rms_norm_reference", "NormImpl", "NORM_IMPLS", "resolve_norm_impl"]
