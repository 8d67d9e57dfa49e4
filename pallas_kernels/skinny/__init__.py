"""Few-row (decode-time) projections: several weights, possibly on different inputs, in one launch."""

from pallas_kernels.skinny.kernel import fused_projections_pallas
from pallas_kernels.skinny.ops import (SKINNY_IMPLS, SKINNY_MAX_ROWS, SkinnyImpl, fused_projections,
                                       resolve_skinny_impl, skinny_matmul)
from pallas_kernels.skinny.plan import Segment, SkinnyBlocks, plan
from pallas_kernels.skinny.reference import fused_projections_reference

__all__ = [
    "fused_projections", "skinny_matmul", "resolve_skinny_impl", "SkinnyImpl", "SKINNY_IMPLS", "SKINNY_MAX_ROWS",
    "fused_projections_pallas", "fused_projections_reference", "SkinnyBlocks", "Segment", "plan",
]
