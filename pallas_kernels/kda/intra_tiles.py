"""The intra-chunk KDA kernels by 16-row tiles: A_kk and A_qk (`ChunkBlocks(pairs="tiles")`, the same outputs
as `intra_parallel.joint_pairs_kernel` with about a quarter of its matrix-product work) and the solve
(`ChunkBlocks(solve="tiles")`, `tile_solve_kernel`, the same outputs as `intra_parallel.solve_kernel`).

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
kernel. The [16, 16] products run on mma.sync, not warpgroup MMAs. Not yet timed on the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.intra_parallel import INVERSE_PRECISION, SUB, _dot_t, _level_factors, doubling_inverse

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


def tile_solve_kernel(akk_ref, q_ref, k_ref, v_ref, l_ref, b_ref, w_ref, u_ref, qg_ref, kt_ref, dec_ref, *,
                      scale: float, key_slice: int, value_slice: int, inverse: str, interpret: bool):
    """`intra_parallel.solve_kernel` by 16-row tiles (`ChunkBlocks(solve="tiles")`): the same outputs.

    T = (I + L)^-1 (L = diag(beta) A_kk, strictly lower) is block lower-triangular: each diagonal tile is the
    doubling inverse of its own 16 rows (three levels of [16, 16] products), and the tiles below follow by
    block forward substitution, T_bc = -T_bb sum_{c <= m < b} L_bm T_mc. At C = 64 that is 40 [16, 16]
    products against the doubling's 10 [64, 64] ones (16x fewer multiply-adds). W and U are then the
    tile products of T's lower triangle with diag(beta) e^G k and diag(beta) v, row block by row block.
    ptxas for sm_90 (`triton_resources.py --cases kda-chunk-all-tiles`): 255 registers, 24 bytes of spills,
    85 layout conversions and 103 barriers, against 232 / 0 / 14 / 19 for the doubling kernel: every tile
    product converts its operands, so fewer multiply-adds may not mean less time. Not yet timed on the GPU."""
    f32 = jnp.float32
    c, kd = q_ref.shape
    vd = v_ref.shape[1]
    nb = c // TILE
    r = jnp.arange(TILE, dtype=jnp.int32)
    cols = r[None, :]
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=f32)
    precise = jax.lax.Precision.HIGHEST if interpret else INVERSE_PRECISION[inverse]
    dot_inv = lambda a, b: jnp.dot(a, b, precision=precise, preferred_element_type=f32)
    rb = [pl.ds(i * TILE, TILE) for i in range(nb)]
    betas = [b_ref[rb[i]].astype(f32) for i in range(nb)]
    lower = lambda i, j: akk_ref[rb[i], rb[j]] * betas[i][:, None]          # L's tile (i, j), j < i

    t = {(i, i): doubling_inverse(jnp.where(r[:, None] > cols, lower(i, i), 0.0), r, cols, dot_inv)
         for i in range(nb)}
    for i in range(1, nb):
        for j in range(i - 1, -1, -1):
            acc = dot_inv(lower(i, j), t[j, j])
            for m in range(j + 1, i):
                acc = acc + dot_inv(lower(i, m), t[m, j])
            t[i, j] = -dot_inv(t[i, i], acc)

    def times_t(parts):
        """Row blocks of T @ X for X given by its row blocks [16, n]."""
        out = []
        for i in range(nb):
            acc = dot(t[i, 0], parts[0])
            for j in range(1, i + 1):
                acc = acc + dot(t[i, j], parts[j])
            out.append(acc)
        return out

    def key_part(i, carry):
        ks = pl.ds(pl.multiple_of(i * key_slice, key_slice), key_slice)
        offsets = [jnp.zeros((key_slice,), f32)]
        for b in range(nb):
            offsets.append(offsets[-1] + l_ref[b * TILE + TILE - 1, ks])
        last = offsets[-1]
        parts = []
        for b in range(nb):
            g = l_ref[rb[b], ks] + offsets[b][None, :]                           # G of block b's rows
            e_g = jnp.exp(g)
            k = k_ref[rb[b], ks].astype(f32)
            parts.append(betas[b][:, None] * e_g * k)
            qg_ref[rb[b], ks] = ((q_ref[rb[b], ks].astype(f32) * scale) * e_g).astype(qg_ref.dtype)
            kt_ref[rb[b], ks] = (k * jnp.exp(last[None, :] - g)).astype(kt_ref.dtype)
        for b, w in enumerate(times_t(parts)):
            w_ref[rb[b], ks] = w.astype(w_ref.dtype)
        dec_ref[ks] = jnp.exp(last)
        return carry

    def value_part(i, carry):
        vs = pl.ds(pl.multiple_of(i * value_slice, value_slice), value_slice)
        parts = [betas[b][:, None] * v_ref[rb[b], vs].astype(f32) for b in range(nb)]
        for b, u in enumerate(times_t(parts)):
            u_ref[rb[b], vs] = u.astype(u_ref.dtype)
        return carry

    jax.lax.fori_loop(0, kd // key_slice, key_part, 0)
    jax.lax.fori_loop(0, vd // value_slice, value_part, 0)
