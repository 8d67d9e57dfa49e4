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
    are used whole).

    For unsorted pairs on MXFP4 weights, `gemv` computes each row on the CUDA cores (multiply-adds
    into a [block_k/2, block_n] accumulator, summed once at the end) instead of a 16-row tensor-core
    tile, and `e2m1` picks the decode: "bits" (three integer ops per value, `mxfp4.decode_e2m1_raw`)
    or "table" (`mxfp4.decode_e2m1`, the form the tile kernels use)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    gemv: bool = False
    e2m1: str = "bits"

    @classmethod
    def for_rows(cls, rows_per_group: float, packed: bool = False, interpreted: bool = False) -> "TileBlocks":
        """Decode-sized groups (a few rows each) stream weights with 16-row tiles; prefill-sized
        groups use wide tiles so each weight tile is reused across many rows. Packed (MXFP4) weights
        take deeper steps in prefill tiles (a quarter of the bytes per value); in decode (one row
        per pair) they run on the CUDA cores, with the bit decode when compiled and the table decode
        when `interpreted` (the bit decode passes codes +-0.5 through subnormals, which XLA's CPU
        flushes to zero)."""
        if rows_per_group <= 32:
            return cls(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4 if not packed else 3,
                       gemv=packed, e2m1="table" if interpreted else "bits")
        return cls(block_m=64, block_n=128, block_k=128 if packed else 64, num_warps=4, num_stages=3)
