"""Grouped matmuls for routed experts (rows sorted by expert)."""

from pallas_kernels.moe_gmm.activation import GluSpec, glu
from pallas_kernels.moe_gmm.hopper_mxfp4 import (HopperMxfp4Blocks, Mxfp4Columns, WordHandOffColumns,
                                                 grouped_glu_hopper_mxfp4, grouped_matmul_hopper_mxfp4,
                                                 natural_columns, pair_glu_hopper_mxfp4, pair_matmul_hopper_mxfp4,
                                                 to_columns)
from pallas_kernels.moe_gmm.hopper_mxfp4_mlp import HandOffColumns, grouped_mlp_hopper_mxfp4, hand_off_columns
from pallas_kernels.moe_gmm.hopper_mxfp4_routed import routed_mlp_hopper_mxfp4
from pallas_kernels.moe_gmm.mxfp4 import Mxfp4Weight
from pallas_kernels.moe_gmm.kernel import grouped_glu_pallas, grouped_matmul_pallas, pair_glu_pallas, pair_matmul_pallas
from pallas_kernels.moe_gmm.ops import (GMM_IMPLS, GmmImpl, dense_weight, grouped_glu, grouped_matmul, grouped_mlp,
                                       hand_off_runs, pair_glu, pair_matmul, resolve_gmm_impl)
from pallas_kernels.moe_gmm.reference import (grouped_glu_reference, grouped_matmul_reference, pair_glu_reference,
                                              pair_matmul_reference)
from pallas_kernels.moe_gmm.schedule import max_tiles, tile_schedule
from pallas_kernels.moe_gmm.tuning import GmmBlocks, TileBlocks

__all__ = [
    # Ops (dispatch by implementation name)
    "grouped_matmul", "grouped_glu", "grouped_mlp", "pair_matmul", "pair_glu", "GmmImpl", "GMM_IMPLS",
    "resolve_gmm_impl", "dense_weight", "hand_off_runs",
    # Implementations and references
    "grouped_matmul_pallas", "grouped_glu_pallas", "grouped_matmul_reference", "grouped_glu_reference",
    "pair_matmul_pallas", "pair_glu_pallas", "pair_matmul_reference", "pair_glu_reference",
    # Activation, schedule and tile settings
    "GluSpec", "glu", "tile_schedule", "max_tiles", "GmmBlocks", "TileBlocks",
    # Packed MXFP4 weights (pallas_kernels.moe_gmm.mxfp4) and the Hopper kernel on them (hopper_mxfp4)
    "Mxfp4Weight", "Mxfp4Columns", "to_columns", "HopperMxfp4Blocks", "grouped_glu_hopper_mxfp4",
    "grouped_matmul_hopper_mxfp4", "pair_glu_hopper_mxfp4", "pair_matmul_hopper_mxfp4", "grouped_mlp_hopper_mxfp4",
    "HandOffColumns", "WordHandOffColumns", "hand_off_columns", "natural_columns", "routed_mlp_hopper_mxfp4",
]
