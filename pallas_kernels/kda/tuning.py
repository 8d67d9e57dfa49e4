"""Block sizes and launch settings of the KDA kernels (small frozen dataclasses, static args)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeBlocks:
    num_warps: int = 8


@dataclass(frozen=True)
class ChunkBlocks:
    chunk: int = 64          # tokens per chunk (WY form)
    value_block: int = 64    # state columns per program of the sequential kernel
    num_warps: int = 8       # intra-chunk kernel
    inter_num_warps: int = 4
    num_stages: int = 1
