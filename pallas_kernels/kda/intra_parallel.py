"""The intra-chunk KDA kernel without row-serial loops (`ChunkBlocks(intra="parallel")`).

Same outputs as `chunk._intra_kernel` (W, U, A_qk, q e^G, k e^(G_C - G), e^(G_C) per chunk); one
program per (row, head, chunk). What differs is how they are formed:

- The decay is taken as `local`: the cumulative log decay inside each 16-row sub-block (summed by
  XLA before the kernel, `local_cumsum`). G of the chunk is local + the totals of the sub-blocks
  before. Every exponent below is a difference of two of these sums that is <= 0, so any gate
  (Kimi-Linear's unbounded one too) is safe.
- Off-diagonal sub-blocks of A_kk / A_qk (row block i, columns of earlier blocks) are matrix
  products against a reference point at the start of block i: (k_r e^(G_r - G_ref)) (k_j e^(G_ref -
  G_j))^T, one product per row block over the whole chunk (the masks zero what is not block i's).
- The diagonal 16 x 16 sub-blocks need the exponent per pair: 16 steps, step c pairs every row r
  with column 16 * block(r) + c of its own block, whose k and local decay rows are gathered from
  memory, so all sub-blocks advance together over [C, key_slice] tiles (no row extraction).
- (I + L)^-1 of the strictly lower [C, C] matrix L by doubling: with T_s the block-diagonal inverse
  of the s x s diagonal blocks (T_1 = I), T_2s = T_s - T_s L_s T_s where L_s is L's lower-left s x s
  block inside each 2s x 2s diagonal block; log2(C) - 1 levels of two matrix products, the same
  arithmetic as block forward substitution.

The key axis is processed in slices of `key_slice` columns to bound the registers a program holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SUB = 16  # rows per sub-block: the diagonal blocks that need pairwise exponents

# Matrix-product precision of the inverse's doubling steps, compiled: three TF32 products per
# product (about fp32 accuracy on the matrix units); interpret mode runs them in fp32.
INVERSE_PRECISION = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def local_cumsum(g_chunks):
    """[..., C, K] -> the inclusive cumulative sum inside each run of SUB rows, fp32 (C % SUB == 0)."""
    *lead, c, kd = g_chunks.shape
    parts = g_chunks.astype(jnp.float32).reshape(*lead, c // SUB, SUB, kd)
    return jnp.cumsum(parts, axis=-2).reshape(*lead, c, kd)


def _block_offsets(local, rows, nb):
    """local [C, ks] -> (refrow [C, ks]: the decay of all sub-blocks before row r's, refs: that per
    block [ks] (refs[0] = 0), last [ks]: the chunk's total)."""
    refrow = jnp.zeros_like(local)
    acc = jnp.zeros(local.shape[1:], jnp.float32)
    refs = []
    for b in range(nb):
        refs.append(acc)
        refrow = jnp.where((rows // SUB == b)[:, None], acc[None, :], refrow)
        acc = acc + jnp.sum(jnp.where((rows == b * SUB + SUB - 1)[:, None], local, 0.0), axis=0)
    return refrow, refs, acc


def intra_parallel_kernel(q_ref, k_ref, v_ref, l_ref, b_ref, w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, *,
                          scale: float, key_slice: int, value_slice: int, interpret: bool):
    """One chunk. q/k [C, K], v [C, V], l (local cumulative decay) [C, K] fp32, beta [C]."""
    f32 = jnp.float32
    c, kd = q_ref.shape
    vd = v_ref.shape[1]
    nb = c // SUB
    rows = jnp.arange(c, dtype=jnp.int32)
    cols = rows[None, :]
    local_row = rows % SUB
    block_start = rows - local_row
    beta = b_ref[...].astype(f32)
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=f32)
    dot_t = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=f32)
    precise = jax.lax.Precision.HIGHEST if interpret else INVERSE_PRECISION
    dot_inv = lambda a, b: jnp.dot(a, b, precision=precise, preferred_element_type=f32)

    akk = jnp.zeros((c, c), f32)
    aqk = jnp.zeros((c, c), f32)
    for k0 in range(0, kd, key_slice):
        ks = pl.ds(k0, key_slice)
        q = q_ref[:, ks].astype(f32) * scale
        k = k_ref[:, ks].astype(f32)
        local = l_ref[:, ks]
        refrow, refs, _ = _block_offsets(local, rows, nb)
        g_chunk = local + refrow
        # Diagonal sub-blocks: step j pairs row r with row start(r) + j of its block.
        for j in range(SUB):
            partner = block_start + j
            lj = l_ref[partner, ks]
            kj = k_ref[partner, ks].astype(f32)
            e = jnp.exp(jnp.where((local_row >= j)[:, None], local - lj, -jnp.inf))
            kje = kj * e
            put = cols == partner[:, None]
            akk = jnp.where(put, akk + jnp.sum(k * kje, axis=1)[:, None], akk)
            aqk = jnp.where(put, aqk + jnp.sum(q * kje, axis=1)[:, None], aqk)
        # Earlier sub-blocks, against the start of row block i.
        down = jnp.exp(local)
        kd_, qd_ = k * down, q * down
        for i in range(1, nb):
            earlier = (rows < i * SUB)[:, None]
            y = k * jnp.exp(jnp.where(earlier, refs[i][None, :] - g_chunk, -jnp.inf))
            mine = (rows // SUB == i)[:, None]
            akk = akk + dot_t(jnp.where(mine, kd_, 0.0), y)
            aqk = aqk + dot_t(jnp.where(mine, qd_, 0.0), y)
    akk = jnp.where(rows[:, None] > cols, akk * beta[:, None], 0.0)
    aqk_ref[...] = jnp.where(rows[:, None] >= cols, aqk, 0.0)

    # (I + akk)^-1 by doubling the inverted diagonal blocks.
    same = lambda s: (rows[:, None] // (2 * s)) == (cols // (2 * s))
    lower_left = lambda s: same(s) & ((rows[:, None] // s) % 2 == 1) & ((cols // s) % 2 == 0)
    t = jnp.where(rows[:, None] == cols, 1.0, 0.0) - jnp.where(lower_left(1), akk, 0.0)
    s = 2
    while s < c:
        t = t - dot_inv(dot_inv(t, jnp.where(lower_left(s), akk, 0.0)), t)
        s *= 2

    for k0 in range(0, kd, key_slice):
        ks = pl.ds(k0, key_slice)
        q = q_ref[:, ks].astype(f32) * scale
        k = k_ref[:, ks].astype(f32)
        local = l_ref[:, ks]
        refrow, _, last = _block_offsets(local, rows, nb)
        g_chunk = local + refrow
        e_g = jnp.exp(g_chunk)
        w_ref[:, ks] = dot(t, beta[:, None] * e_g * k)
        qg_ref[:, ks] = q * e_g
        kt_ref[:, ks] = k * jnp.exp(last[None, :] - g_chunk)
        dec_ref[ks] = jnp.exp(last)
    for v0 in range(0, vd, value_slice):
        vs = pl.ds(v0, value_slice)
        u_ref[:, vs] = dot(t, beta[:, None] * v_ref[:, vs].astype(f32))
