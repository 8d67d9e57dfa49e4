"""A_kk and A_qk of a KDA chunk by 16-row tiles (`ChunkBlocks(pairs="tiles")`): the same outputs as
`intra_parallel.joint_pairs_kernel` with about a quarter of its matrix-product work.

The joint kernel forms every bit level as a masked [C, C] product, so most of each product is thrown
away: at C = 64 it computes 13 [64, 64] products per key slice (4,096 entries each) to fill two lower
triangles of 2,016 and 2,080 entries. Here the chunk's C / 16 row blocks give (C / 16)^2 tiles of [16, 16]:

- a tile below the diagonal, rows of block b against columns of block c < b: e^(G_r - G_j) =
  e^(G_r - G_f) e^(G_f - G_j) with f the first row of block b; both exponents are <= 0 for any gate
  (G_r <= G_f <= G_j), and G_f - G_j = (totals of blocks c .. b-1) - local_j + local_f, so only block totals
  and local sums enter, never the chunk's running G;
- a tile on the diagonal: the bit levels of `intra_parallel` inside the block (s = 1 .. 8), each a
  [16, 16] product instead of a [C, C] one (per key slice: 36 tile products on the diagonal and 12 below it,
  23% of the joint kernel's multiply-adds at C = 64);
- a tile above the diagonal is written as zeros.

Each tile is its own loop step with two [16, 16] accumulators, so a program holds little more than one
tile's operands (the joint kernel holds both [C, C] accumulators and the slice's q, k and decay across all
levels: 255 registers per thread on sm_90 and spills). Tiles write straight into the [C, C] outputs.
ptxas for sm_90 (`benchmarks/triton_resources.py --cases kda-chunk-tiles`): 148 registers per thread at 4
warps, no spills, 4 KB of shared memory, against 255 registers, 20 bytes of spills and 16 KB for the joint
kernel. The [16, 16] products run on mma.sync, not warpgroup MMAs.

Measured on the H200 (RESULTS.md, KDA run 12: B = 1, T = 8192, bf16, the whole prefill with the joint kernel's
1.93 / 5.16 ms at H = 32 / 96): slower at every warp count, 2.57 / 7.21 ms at 4 warps, 2.10 / 5.72 at 2,
2.00 / 5.44 at 1 (`pairs_num_warps`). Fewer registers and multiply-adds did not buy time; kept as an option
beside the default to measure against. (A tiled solve by block forward substitution, 16x fewer
multiply-adds than the doubling, ran 2.36 / 6.47 ms and was removed.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.intra_parallel import SUB, _dot_t, _level_factors

TILE = SUB   # rows per tile: the sub-blocks of the local cumulative decay


def tile_pairs_kernel(q_ref, k_ref, l_ref, akk_ref, aqk_ref, *, scale: float, key_slice: int):
    """One chunk: q/k [C, K], l (the decay summed inside each 16-row sub-block) [C, K] fp32 ->
    akk [C, C] (j < r) and aqk [C, C] (j <= r, q scaled), zero above the diagonal."""
    f32 = jnp.float32
    c, kd = k_ref.shape
    nb = c // TILE
    slices = kd // key_slice
    local_rows = jnp.arange(TILE, dtype=jnp.int32)
    zero_tile = jnp.zeros((TILE, TILE), f32)
    block = lambda i: pl.ds(pl.multiple_of(i * TILE, TILE), TILE)
    key_cols = lambda i: pl.ds(pl.multiple_of(i * key_slice, key_slice), key_slice)

    def diagonal_tile(b):
        rows = b * TILE + local_rows            # the block's rows in the chunk (the level anchors are rows of l)
        cols = rows[None, :]
        rb = block(b)

        def one_slice(i, accs):
            ks = key_cols(i)
            q = q_ref[rb, ks].astype(f32) * scale
            k = k_ref[rb, ks].astype(f32)
            local = l_ref[rb, ks]
            akk, aqk = accs
            aqk = aqk + jnp.where(rows[:, None] == cols, _dot_t(q, k), 0.0)

            def level(lvl, accs):
                x, y = _level_factors(lvl, True, l_ref, ks, rows, local, None, None)
                same = jnp.right_shift(rows[:, None], lvl + 1) == jnp.right_shift(cols, lvl + 1)
                ky = k * y
                return (accs[0] + jnp.where(same, _dot_t(k * x, ky), 0.0),
                        accs[1] + jnp.where(same, _dot_t(q * x, ky), 0.0))
            return jax.lax.fori_loop(0, TILE.bit_length() - 1, level, (akk, aqk))

        akk, aqk = jax.lax.fori_loop(0, slices, one_slice, (zero_tile, zero_tile))
        akk_ref[rb, rb] = akk
        aqk_ref[rb, rb] = aqk.astype(aqk_ref.dtype)

    def lower_tile(b, cb):
        rb, rc = block(b), block(cb)

        def one_slice(i, accs):
            ks = key_cols(i)
            first = l_ref[b * TILE, ks]                                        # local decay at block b's first row
            # the decay of blocks cb .. b-1: their last rows of `local`
            between = jax.lax.fori_loop(cb, b, lambda j, acc: acc + l_ref[j * TILE + TILE - 1, ks],
                                        jnp.zeros((key_slice,), f32))
            x = jnp.exp(l_ref[rb, ks] - first[None, :])                        # e^(G_r - G_f)
            y = jnp.exp((between[None, :] - l_ref[rc, ks]) + first[None, :])   # e^(G_f - G_j)
            ky = k_ref[rc, ks].astype(f32) * y
            return (accs[0] + _dot_t(k_ref[rb, ks].astype(f32) * x, ky),
                    accs[1] + _dot_t(q_ref[rb, ks].astype(f32) * (scale * x), ky))

        akk, aqk = jax.lax.fori_loop(0, slices, one_slice, (zero_tile, zero_tile))
        akk_ref[rb, rc] = akk
        aqk_ref[rb, rc] = aqk.astype(aqk_ref.dtype)

    def upper_tile(b, cb):
        akk_ref[block(b), block(cb)] = zero_tile
        aqk_ref[block(b), block(cb)] = zero_tile.astype(aqk_ref.dtype)

    def row_block(b, carry):
        diagonal_tile(b)
        jax.lax.fori_loop(0, b, lambda cb, cr: (lower_tile(b, cb), cr)[1], 0)
        jax.lax.fori_loop(b + 1, nb, lambda cb, cr: (upper_tile(b, cb), cr)[1], 0)
        return carry

    jax.lax.fori_loop(0, nb, row_block, 0)
