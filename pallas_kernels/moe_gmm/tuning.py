"""Tile sizes and launch settings of the grouped-matmul kernels (frozen, hashable: static args)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GmmBlocks:
    """JAX's Hopper Mosaic GPU kernel (`ragged_dot_mgpu`)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


@dataclass(frozen=True)
class TileBlocks:
    """The row-tiled Pallas kernel (`kernel.py`): rows per tile, output columns and reduction depth
    per program step, launch settings. Block sizes are powers of two >= 16 (smaller matrix sides
    are used whole)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4

    @classmethod
    def for_rows(cls, rows_per_group: float, packed: bool = False) -> "TileBlocks":
        """Decode-sized groups (a few rows each) stream weights with 16-row tiles; prefill-sized
        groups use wide tiles so each weight tile is reused across many rows. Packed (MXFP4) weights
        take deeper steps: a quarter of the bytes per value, so more inputs per step keep as many
        bytes in flight."""
        if rows_per_group <= 32:
            return cls(block_m=16, block_n=64, block_k=256 if packed else 128, num_warps=4, num_stages=4)
        return cls(block_m=64, block_n=128, block_k=128 if packed else 64, num_warps=4, num_stages=3)
