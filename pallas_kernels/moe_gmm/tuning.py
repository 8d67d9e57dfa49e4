"""Tile sizes and launch settings of the grouped-matmul kernels (frozen, hashable: static args)."""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels._util import SM_COUNT

E2M1_DECODES = ("asm", "bits", "table")


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
    tile, and `e2m1` picks the decode: "asm" (inline PTX on the four bytes of a register, three
    integer instructions per value, `mxfp4_asm.py`; compiled only), "bits" (the same bit placement
    in JAX ops on each byte, `mxfp4.decode_e2m1_raw`) or "table" (`mxfp4.decode_e2m1`). Tensor-core
    tiles take "asm" (raw bf16 pairs from PTX, bf16 activations only) or otherwise the table.
    `split_k` (`gemv` only): parts of the reduction run by separate programs and summed after the
    launch (0: enough parts for about two programs per SM; 1: none)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    gemv: bool = False
    e2m1: str = "bits"
    split_k: int = 1

    @classmethod
    def for_rows(cls, rows_per_group: float, packed: bool = False, interpreted: bool = False) -> "TileBlocks":
        """Decode-sized groups (a few rows each) stream weights with 16-row tiles; prefill-sized
        groups use wide tiles so each weight tile is reused across many rows. Packed (MXFP4) weights
        take deeper steps in prefill tiles (a quarter of the bytes per value); in decode (one row
        per pair) they run on the CUDA cores, with the inline-PTX decode when compiled and the table
        decode when `interpreted` (inline PTX runs only compiled, and the bit forms pass codes +-0.5
        through subnormals, which XLA's CPU flushes to zero), and the reduction split over programs
        when a launch has too few of them. Sorted rows (16-row tiles for a few rows per group, wide ones
        above) decode to raw bf16 in inline PTX when compiled (`benchmarks/moe_mxfp4.py`, H200 run 7:
        1.2x the table decode at 256 and 4,096 tokens in wide tiles)."""
        ptx = "asm" if packed and not interpreted else "table"
        if rows_per_group <= 32:    # packed: pairs on the CUDA cores, sorted rows in 16-row tiles, both in PTX
            return cls(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4 if not packed else 3,
                       gemv=packed, e2m1=ptx, split_k=0 if packed else 1)
        return cls(block_m=64, block_n=128, block_k=128 if packed else 64, num_warps=4, num_stages=3, e2m1=ptx)

    @classmethod
    def for_pairs(cls, pairs: int, k_dim: int, n_dim: int, packed: bool = False,
                  interpreted: bool = False) -> "TileBlocks":
        """Unsorted pairs (one row each) of [k_dim, n_dim] weights. Packed weights: `for_rows(1)`.
        bf16 (`benchmarks/pair_tiles.py` on the H200, B=1 of the 48B shape): 64-deep steps when the
        reduction is short (the down projection, K=1024: 16.2 us for 18.7 with 128-deep steps), and
        128-wide column blocks with 8 warps when 64-wide ones would leave a second, nearly empty wave
        of programs that 128-wide ones avoid (gate|up of 8 routed + 1 shared pair: 144 programs ->
        72, 27.9 us for 31.2)."""
        if packed:
            return cls.for_rows(1, packed=True, interpreted=interpreted)
        block_k = 64 if k_dim <= 1024 else 128
        waves = lambda bn: pairs * -(-n_dim // bn) / SM_COUNT
        if waves(64) > 1 >= waves(128):
            return cls(block_m=16, block_n=128, block_k=block_k, num_warps=8, num_stages=3)
        return cls(block_m=16, block_n=64, block_k=block_k, num_warps=4, num_stages=4)
