"""RMSNorm of a few rows in one launch (decode), with its XLA twin."""

from pallas_kernels.rms_norm.kernel import rms_norm_pallas
from pallas_kernels.rms_norm.ops import NORM_IMPLS, NormImpl, rms_norm
from pallas_kernels.rms_norm.reference import rms_norm_reference

__all__ = ["rms_norm", "rms_norm_pallas", "rms_norm_reference", "NormImpl", "NORM_IMPLS"]
