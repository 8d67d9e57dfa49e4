"""The intra-chunk KDA kernel without row-serial loops (`ChunkBlocks(intra="parallel")`).

Same outputs as `chunk._intra_kernel` (W, U, A_qk, q e^G, k e^(G_C - G), e^(G_C) per chunk); one
program per (row, head, chunk). What differs is how they are formed:

- The decay is taken as `local`: the cumulative log decay inside each 16-row sub-block (summed by
  XLA before the kernel, `local_cumsum`). G of the chunk is local + the totals of the sub-blocks
  before. Every exponent below is a difference of two of these sums that is <= 0, so any gate
  (Kimi-Linear's unbounded one too) is safe.
- A_kk and A_qk by levels: level s holds the pairs (r, j), j < r, whose indices first differ in
  the bit of s (r in the upper, j in the lower half of one 2s-row block). For them
  e^(G_r - G_j) = e^(G_r - G_a) e^(G_a - G_j) with a the last row of j's half, both factors <= 1, so
  each level is one matrix product of row-scaled k (or q) against column-scaled k, masked to its
  blocks: log2(C) products and no pairwise exponent table, whatever the gate. The decay anchors
  inside a sub-block are gathered from `local`; across sub-blocks they are the sub-block offsets.
- (I + L)^-1 of the strictly lower [C, C] matrix L by doubling: with T_s the block-diagonal inverse
  of the s x s diagonal blocks (T_1 = I), T_2s = T_s - T_s L_s T_s where L_s is L's lower-left s x s
  block inside each 2s x 2s diagonal block; log2(C) - 1 levels of two matrix products, the same
  arithmetic as block forward substitution.

The key axis is processed in slices of `key_slice` columns to bound the registers a program holds.
Matrix products run on the matrix units (TF32 for the level products, as for the other kernels'
products of fp32 values).

Measured on the H200 (B = 1, T = 8192, K = V = 128; RESULTS.md "KDA prefill: an intra-chunk kernel
without row-serial loops"): exact in the compiled tests but slower than "blocked", 4.95 against
3.50 ms at H = 32 (key_slice 64) and 13.7 against 9.7 ms at H = 96; an earlier form that paired rows
in 16 gathered steps was slower still (5.0-8.0 ms). So "blocked" stays the default; this form keeps
all of A_kk's exponent work in matrix products, the shape a tensor-core (Mosaic GPU) kernel wants.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SUB = 16  # rows per run of the local cumulative decay (`local_cumsum`): keeps its sums small

# Matrix-product precision of the inverse's doubling steps, compiled: three TF32 products per
# product (about fp32 accuracy on the matrix units); interpret mode runs them in fp32.
INVERSE_PRECISION = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def local_cumsum(g_chunks):
    """[..., C, K] -> the inclusive cumulative sum inside each run of SUB rows, fp32 (C % SUB == 0)."""
    *lead, c, kd = g_chunks.shape
    parts = g_chunks.astype(jnp.float32).reshape(*lead, c // SUB, SUB, kd)
    return jnp.cumsum(parts, axis=-2).reshape(*lead, c, kd)


def _block_offsets(local, rows, nb):
    """local [C, ks] -> (refrow [C, ks]: the decay of all sub-blocks before row r's, offsets: that
    at the start of each block and after the last, nb + 1 vectors [ks] (offsets[0] = 0))."""
    refrow = jnp.zeros_like(local)
    acc = jnp.zeros(local.shape[1:], jnp.float32)
    offsets = [acc]
    for b in range(nb):
        refrow = jnp.where((rows // SUB == b)[:, None], acc[None, :], refrow)
        acc = acc + jnp.sum(jnp.where((rows == b * SUB + SUB - 1)[:, None], local, 0.0), axis=0)
        offsets.append(acc)
    return refrow, offsets


def _pick(rows_index, vectors):
    """[C, ks] whose row r is vectors[rows_index[r]] (a short static list of [ks] vectors)."""
    out = jnp.broadcast_to(vectors[0][None, :], (rows_index.shape[0], vectors[0].shape[0]))
    for i in range(1, len(vectors)):
        out = jnp.where((rows_index == i)[:, None], vectors[i][None, :], out)
    return out


def _slice(q_ref, k_ref, l_ref, ks, rows, nb, scale):
    """The key slice ks of one chunk: q * scale, k (fp32), local decay, its block offsets and G."""
    q = q_ref[:, ks].astype(jnp.float32) * scale
    k = k_ref[:, ks].astype(jnp.float32)
    local = l_ref[:, ks]
    refrow, offsets = _block_offsets(local, rows, nb)
    return q, k, local, refrow, offsets, local + refrow


def _level_factors(s, l_ref, ks, rows, local, refrow, offsets):
    """Row and column decay factors of level s: every pair (r, j), j < r, whose indices first differ
    in the bit of s (r in the upper, j in the lower half of one 2s-row block) has
    e^(G_r - G_j) = x[r] * y[j] with x[r] = e^(G_r - G_a) and y[j] = e^(G_a - G_j), a the last row of
    j's half; both exponents <= 0. x is zero on lower-half rows, y on upper-half rows."""
    upper = ((rows // s) % 2 == 1)[:, None]
    start = rows - rows % s                    # first row of r's s-row half
    if s < SUB:   # inside a sub-block: the local sums of the rows around the anchor, gathered
        before = l_ref[jnp.maximum(start - 1, 0), ks]
        anchor_of_j = l_ref[start + s - 1, ks]
        x_exp, y_exp = local - before, anchor_of_j - local
    else:         # across sub-blocks: the anchor is a sub-block boundary, G_a one of the offsets
        g_r = local + refrow
        x_exp = g_r - _pick(start // SUB, offsets)
        y_exp = _pick((start + s) // SUB, offsets) - g_r
    return (jnp.exp(jnp.where(upper, x_exp, -jnp.inf)), jnp.exp(jnp.where(upper, -jnp.inf, y_exp)))


def intra_parallel_kernel(q_ref, k_ref, v_ref, l_ref, b_ref, w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, *,
                          scale: float, key_slice: int, value_slice: int, interpret: bool):
    """One chunk. q/k [C, K], v [C, V], l (local cumulative decay) [C, K] fp32, beta [C]."""
    f32 = jnp.float32
    c, kd = q_ref.shape
    vd = v_ref.shape[1]
    nb = c // SUB
    rows = jnp.arange(c, dtype=jnp.int32)
    cols = rows[None, :]
    beta = b_ref[...].astype(f32)
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=f32)
    dot_t = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=f32)
    precise = jax.lax.Precision.HIGHEST if interpret else INVERSE_PRECISION
    dot_inv = lambda a, b: jnp.dot(a, b, precision=precise, preferred_element_type=f32)
    same = lambda s: (rows[:, None] // (2 * s)) == (cols // (2 * s))

    akk = jnp.zeros((c, c), f32)
    aqk = jnp.zeros((c, c), f32)
    for k0 in range(0, kd, key_slice):
        ks = pl.ds(k0, key_slice)
        q, k, local, refrow, offsets, _ = _slice(q_ref, k_ref, l_ref, ks, rows, nb, scale)
        aqk = aqk + jnp.where(rows[:, None] == cols, dot_t(q, k), 0.0)
        s = 1
        while s < c:
            x, y = _level_factors(s, l_ref, ks, rows, local, refrow, offsets)
            ky = k * y
            akk = akk + jnp.where(same(s), dot_t(k * x, ky), 0.0)
            aqk = aqk + jnp.where(same(s), dot_t(q * x, ky), 0.0)
            s *= 2
    akk = jnp.where(rows[:, None] > cols, akk * beta[:, None], 0.0)
    aqk_ref[...] = aqk

    # (I + akk)^-1 by doubling the inverted diagonal blocks.
    lower_left = lambda s: same(s) & ((rows[:, None] // s) % 2 == 1) & ((cols // s) % 2 == 0)
    t = jnp.where(rows[:, None] == cols, 1.0, 0.0) - jnp.where(lower_left(1), akk, 0.0)
    s = 2
    while s < c:
        t = t - dot_inv(dot_inv(t, jnp.where(lower_left(s), akk, 0.0)), t)
        s *= 2

    for k0 in range(0, kd, key_slice):
        ks = pl.ds(k0, key_slice)
        q, k, _, _, offsets, g_chunk = _slice(q_ref, k_ref, l_ref, ks, rows, nb, scale)
        last = offsets[-1]
        e_g = jnp.exp(g_chunk)
        w_ref[:, ks] = dot(t, beta[:, None] * e_g * k)
        qg_ref[:, ks] = q * e_g
        kt_ref[:, ks] = k * jnp.exp(last[None, :] - g_chunk)
        dec_ref[ks] = jnp.exp(last)
    for v0 in range(0, vd, value_slice):
        vs = pl.ds(v0, value_slice)
        u_ref[:, vs] = dot(t, beta[:, None] * v_ref[:, vs].astype(f32))
