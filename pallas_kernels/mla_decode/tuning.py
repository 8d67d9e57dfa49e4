"""Launch settings of the MLA decode kernel."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLADecodeBlocks:
    block_h: int = 32       # query rows (heads x query tokens) per program; padded to this
    block_k: int = 64       # cache slots per inner step (must divide the cache length)
    num_splits: int = 0     # programs along the sequence per row; 0 = choose from the sizes
    num_warps: int = 8      # H200 sweep at 64 x 4K: (32, 64, 8 warps, 2 stages) was fastest
    num_stages: int = 2

    def splits_for(self, batch: int, heads_blocks: int, slots: int, sms: int = 132) -> int:
        """Enough programs to fill the GPU, each with at least 4 cache blocks."""
        if self.num_splits:
            return self.num_splits
        want = max(1, -(-2 * sms // max(1, batch * heads_blocks)))
        return max(1, min(want, slots // (4 * self.block_k)))
