"""Block sizes and launch settings of the KDA kernels (small frozen dataclasses, static args)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeBlocks:
    num_warps: int = 4   # H200 sweep: 4 beat 8 and 16 at every batch (benchmarks/RESULTS.md)


@dataclass(frozen=True)
class ChunkBlocks:
    chunk: int = 64          # tokens per chunk (WY form)
    intra: str = "blocked"   # intra-chunk kernel: "blocked" (sub-block matmuls) or "column" (pairwise loop)
    sub_chunk: int = 16      # rows per sub-block of the blocked intra kernel
    value_block: int = 32    # state columns per program of the sequential kernel
    num_warps: int = 4       # intra-chunk kernel (H200: 4 beat 8)
    inter_num_warps: int = 4
    num_stages: int = 1
