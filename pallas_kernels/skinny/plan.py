"""Static launch plan of the fused few-row projections: which program computes which column block
of which weight over which slice of the reduction axis.

Groups share one launch. Group g has one input x_g [M, K_g] and weights w_gj [K_g, N_gj] whose
products are written side by side into output g ([M, sum_j N_gj]). Every weight's columns are cut
into blocks of `bn` (the largest power of two <= block_n dividing N), and a group's reduction axis
into `splits` equal slices when the columns alone give too few programs to keep every SM streaming
(narrow weights such as 4096 -> 2304); split groups write fp32 partial sums [splits, M, N] that the
caller adds up. A launch whose columns alone give at least `unsplit_programs` programs (one per SM)
is not split, so its outputs need no adding up (KDA's q|k|v|f_a|b|g: 197 programs). Narrower column
blocks (down to `min_block_n`) may be tried first to reach the program target without a split; by
default they are not (on the H200, 32-wide blocks of bf16 stream slower than 64-wide ones:
`benchmarks/skinny.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels._util import largest_block


@dataclass(frozen=True)
class SkinnyBlocks:
    """block_n / block_k: largest column block and reduction step (powers of two >= 16); min_block_n:
    the narrowest column block tried before splitting the reduction axis. unsplit_programs: launches
    with at least this many column blocks are never split.
    target_programs: split the reduction axis until the launch has about this many programs (two
    per SM of an H200). min_split_k: no reduction slice shorter than this."""

    block_n: int = 64
    min_block_n: int = 64
    block_k: int = 128
    target_programs: int = 264
    unsplit_programs: int = 132
    min_split_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@dataclass(frozen=True)
class Segment:
    """One weight's share of the launch: programs [first, first + blocks * splits), program
    first + c * splits + s computes columns [c * bn, (c + 1) * bn) over reduction slice s."""

    group: int
    weight: int          # index into the flat weight list
    out_col: int         # first column of this weight in its group's output
    k_dim: int
    n_dim: int
    bn: int
    bk: int
    splits: int
    first: int

    @property
    def programs(self) -> int:
        return self.n_dim // self.bn * self.splits


def _splits(k_dim: int, bk: int, columns: int, blocks: SkinnyBlocks) -> int:
    """The fewest reduction slices (a divisor of K / bk) that bring `columns` blocks up to the target
    program count, with no slice shorter than min_split_k (or bk)."""
    units = k_dim // bk
    divisors = [d for d in range(1, units + 1)
                if units % d == 0 and (d == 1 or k_dim // d >= max(blocks.min_split_k, bk))]
    enough = [d for d in divisors if columns * d >= blocks.target_programs]
    return min(enough) if enough else max(divisors)


def plan(shapes: tuple[tuple[int, tuple[int, ...]], ...], blocks: SkinnyBlocks) -> tuple[Segment, ...]:
    """shapes: per group (K, (N of each weight)); every side a multiple of 16. -> the segments, in
    weight order, with consecutive program ranges."""
    layout = _layout(shapes, blocks, blocks.block_n)
    columns = _columns(layout)
    block_n = blocks.block_n // 2
    while columns < blocks.target_programs and block_n >= max(16, blocks.min_block_n):
        narrow = _layout(shapes, blocks, block_n)
        if _columns(narrow) >= blocks.target_programs:
            layout, columns = narrow, _columns(narrow)
        block_n //= 2
    segments, first, weight = [], 0, 0
    for g, (k_dim, bk, widths, bns) in enumerate(layout):
        splits = 1 if columns >= blocks.unsplit_programs else _splits(k_dim, bk, columns, blocks)
        col = 0
        for n, bn in zip(widths, bns):
            seg = Segment(group=g, weight=weight, out_col=col, k_dim=k_dim, n_dim=n, bn=bn, bk=bk, splits=splits,
                          first=first)
            segments.append(seg)
            first += seg.programs
            col += n
            weight += 1
    return tuple(segments)


def _layout(shapes, blocks: SkinnyBlocks, block_n: int):
    """Per group (K, bk, widths, column block of each weight) with column blocks of at most block_n."""
    layout = []
    for g, (k_dim, widths) in enumerate(shapes):
        bk = largest_block(k_dim, blocks.block_k)
        bns = [largest_block(n, block_n) for n in widths]
        if bk is None or None in bns:
            raise ValueError(f"fused projections: group {g} has K={k_dim}, N={widths}; every side must be a "
                             "multiple of 16")
        layout.append((k_dim, bk, widths, bns))
    return layout


def _columns(layout) -> int:
    return sum(n // bn for _, _, widths, bns in layout for n, bn in zip(widths, bns))
