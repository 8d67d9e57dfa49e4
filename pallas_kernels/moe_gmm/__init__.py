"""Grouped matmul for routed experts (rows sorted by expert)."""

from pallas_kernels.moe_gmm.ops import GMM_IMPLS, GmmBlocks, GmmImpl, grouped_matmul, grouped_matmul_reference

__all__ = ["GMM_IMPLS", "GmmImpl", "GmmBlocks", "grouped_matmul", "grouped_matmul_reference"]
