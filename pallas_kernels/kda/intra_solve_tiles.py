"""The pairs across a KDA chunk's 16-row sub-blocks and T = (I + diag(beta) A_kk)^-1 by 16 x 16 tiles
(`ChunkBlocks(across="tiles")`): the launch after `intra_diagonal.py`'s per-token one, with the same outputs as
`intra_parallel.joint_pairs_kernel(diagonal_given=True, invert=...)` (with `qg_in_pairs` also q e^G), in about a
tenth of its multiply-adds.

The joint launch forms each bit level across sub-blocks as a masked [C, C] product and the inverse by doubling over
the whole [C, C] matrix: at C = 64 about 4.7 M multiply-adds a chunk, most of them on entries that are masked away
or known to be zero. Here, with C / 16 = nb row blocks:

- Tile (i, j), j < i, of A_kk and A_qk is one [16, K] x [K, 16] product. With G_a the cumulative decay at the end of
  block i - 1 (the start of block i), e^(G_r - G_j) = e^(G_r - G_a) e^(G_a - G_j) for r in block i and j in block
  j, and in terms of the local sums (each sub-block's own running sum, `local_cumsum`) and block totals:

      G_r - G_a = local_r,   G_a - G_j = (total_j - local_j) + (totals of blocks j + 1 .. i - 1),

  each term <= 0 for any gate, so every factor is <= 1: k_r e^(local_r) for the rows, k_j e^(total_j - local_j) for
  the columns (formed once per block), and e^(totals between) for the pairs two or more blocks apart.
- T by block forward substitution: the diagonal tiles' inverses (I + L_ii)^-1 by doubling inside each 16 x 16
  tile (`intra_parallel.doubling_inverse`, three levels), then T_ij = -T_ii sum_{m = j .. i - 1} L_im T_mj.

Two forms of the products across sub-blocks, both the defaults since KDA run 31: their exponentials as
2^(x log2 e) (`pairs_exp2`: one ex2.approx and a multiply instead of e^x's longer sequence) and every block pair in
one loop over key slices (`pairs_one_loop`, `_across_products_joint`: fewer loads and exponentials, more live
accumulators). Together on the H200 (B = 1, T = 8192, H = 32) this launch took 205 us against 271 with neither.
With `qg_in_pairs` the launch also writes q e^G, which the W, U launch then leaves out (opt-in: slower in run 31).

Measured on the H200 (RESULTS.md, KDA runs 25-27; B = 1, T = 8192, H = 32 / 96): the multiply-adds were not what
the levels' launch waited on. At 1 warp and 32 key columns a step this form took 352 / 1,053 us against the levels'
352 / 1,028, at 4 warps 918 / 2,697 (a [16, 16] tile sits whole in every warp, so 4 warps repeat one another's
work). With 16 key columns a step and the key-slice loops' loads pipelined in 3 stages (1 warp, 168 registers: the
default, `ChunkBlocks.pairs_launch`) it takes 342-344 / 959-966 us.

The diagonal tiles of A_kk and A_qk come from the per-token launch: its band ([C, 16], row r's entries of its own
sub-block; `intra_diagonal.diagonal_pairs(band=True)`) holds them stacked, or its whole rows ([C, C]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.intra_diagonal import LOG2_E
from pallas_kernels.kda.intra_parallel import SUB, _dot_t, _inverse_dot, doubling_inverse


def _block(i: int):
    return pl.ds(i * SUB, SUB)


def _first_block_qg(q_ref, l_ref, qg_ref, ks, *, scale: float, exp):
    """Key slice ks of q e^G (q scaled) for the chunk's first row block, where G is the local decay."""
    qg_ref[_block(0), ks] = (q_ref[_block(0), ks].astype(jnp.float32) * (exp(l_ref[_block(0), ks]) * scale)
                             ).astype(qg_ref.dtype)


def _across_products(q_ref, k_ref, l_ref, *, scale: float, key_slice: int, exp2: bool = False, qg_ref=None):
    """{(i, j): A_kk tile}, {(i, j): A_qk tile} ([SUB, SUB] fp32, q scaled) for the block pairs j < i: one
    row block i at a time (its i tile pairs, two [SUB, SUB] accumulators each: a [16, 16] tile sits whole in
    every warp, so fewer live tiles is fewer registers), summed over key slices of key_slice columns in a loop.
    exp2: each e^x taken as 2^(x log2 e) (`ChunkBlocks.pairs_exp2`). qg_ref: also write q e^G ([C, K], q
    scaled; `ChunkBlocks.qg_in_pairs`) from the rows' factors, times e^(G_a) of their block's start."""
    f32 = jnp.float32
    exp = (lambda x: jnp.exp2(x * LOG2_E)) if exp2 else jnp.exp
    nb = q_ref.shape[0] // SUB
    slices = q_ref.shape[1] // key_slice
    if qg_ref is not None and nb == 1:               # one row block: no pairs loop to write it in

        def first_only(s, carry):
            _first_block_qg(q_ref, l_ref, qg_ref, pl.ds(pl.multiple_of(s * key_slice, key_slice), key_slice),
                            scale=scale, exp=exp)
            return carry

        jax.lax.fori_loop(0, slices, first_only, 0)
    akk, aqk = {}, {}
    for i in range(1, nb):
        def one_slice(s, accs, i=i):
            ks = pl.ds(pl.multiple_of(s * key_slice, key_slice), key_slice)
            e = exp(l_ref[_block(i), ks])                                    # e^(G_r - G_a), <= 1
            xk = k_ref[_block(i), ks].astype(f32) * e
            xq = q_ref[_block(i), ks].astype(f32) * (e * scale)
            out, between = list(accs), None                # the decay of the whole blocks between j and i
            for j in range(i - 1, -1, -1):
                total = l_ref[j * SUB + SUB - 1, ks]                             # [ks]
                y = k_ref[_block(j), ks].astype(f32) * exp(total[None, :] - l_ref[_block(j), ks])
                if between is not None:
                    y = y * exp(between)[None, :]
                out[2 * j] = out[2 * j] + _dot_t(xk, y)
                out[2 * j + 1] = out[2 * j + 1] + _dot_t(xq, y)
                between = total if between is None else between + total
            if qg_ref is not None:              # between is now G_a: the decay of every block before i
                qg_ref[_block(i), ks] = (xq * exp(between)[None, :]).astype(qg_ref.dtype)
                if i == 1:
                    _first_block_qg(q_ref, l_ref, qg_ref, ks, scale=scale, exp=exp)
            return tuple(out)

        zeros = (jnp.zeros((SUB, SUB), f32),) * (2 * i)
        accs = jax.lax.fori_loop(0, slices, one_slice, zeros)
        for j in range(i):
            akk[i, j], aqk[i, j] = accs[2 * j], accs[2 * j + 1]
    return akk, aqk


def _across_products_joint(q_ref, k_ref, l_ref, *, scale: float, key_slice: int, exp2: bool = False, qg_ref=None):
    """`_across_products` in one loop over key slices for every block pair (`ChunkBlocks.pairs_one_loop`): each
    step loads every block of k and l and the row blocks of q once and takes each block's row and column factors
    once (at C = 64: 11 tile loads and 6 tile exponentials a step instead of 21 and 9), holding all the pairs'
    accumulators. qg_ref: as in `_across_products`."""
    f32 = jnp.float32
    exp = (lambda x: jnp.exp2(x * LOG2_E)) if exp2 else jnp.exp
    nb = q_ref.shape[0] // SUB
    pairs = [(i, j) for i in range(1, nb) for j in range(i)]

    def one_slice(s, accs):
        ks = pl.ds(pl.multiple_of(s * key_slice, key_slice), key_slice)
        local = [l_ref[_block(b), ks] for b in range(nb)]
        keys = [k_ref[_block(b), ks].astype(f32) for b in range(nb)]
        totals = [l_ref[b * SUB + SUB - 1, ks] for b in range(nb - 1)]             # each block's decay [ks]
        rows_k, rows_q = {}, {}
        for i in range(1, nb):
            e = exp(local[i])                                                      # e^(G_r - G_a), <= 1
            rows_k[i] = keys[i] * e
            rows_q[i] = q_ref[_block(i), ks].astype(f32) * (e * scale)
        if qg_ref is not None:
            _first_block_qg(q_ref, l_ref, qg_ref, ks, scale=scale, exp=exp)
            start = None                                   # G_a of block i: the decay of every block before it
            for i in range(1, nb):
                start = totals[i - 1] if start is None else start + totals[i - 1]
                qg_ref[_block(i), ks] = (rows_q[i] * exp(start)[None, :]).astype(qg_ref.dtype)
        out = list(accs)
        for j in range(nb - 1):
            y = keys[j] * exp(totals[j][None, :] - local[j])
            between = None                                 # the decay of the whole blocks between j and i
            for i in range(j + 1, nb):
                y_i = y if between is None else y * exp(between)[None, :]
                p = pairs.index((i, j))
                out[2 * p] = out[2 * p] + _dot_t(rows_k[i], y_i)
                out[2 * p + 1] = out[2 * p + 1] + _dot_t(rows_q[i], y_i)
                if i < nb - 1:
                    between = totals[i] if between is None else between + totals[i]
        return tuple(out)

    zeros = (jnp.zeros((SUB, SUB), f32),) * (2 * len(pairs))
    accs = jax.lax.fori_loop(0, q_ref.shape[1] // key_slice, one_slice, zeros)
    return ({pair: accs[2 * p] for p, pair in enumerate(pairs)},
            {pair: accs[2 * p + 1] for p, pair in enumerate(pairs)})


def tile_solve_kernel(q_ref, k_ref, l_ref, b_ref, *refs, scale: float, key_slice: int, band: bool, inverse: str,
                      scaled: bool = False, exp2: bool = False, one_loop: bool = False, with_qg: bool = False,
                      interpret: bool = False):
    """One chunk: q, k [C, K] (L2-normalised, or with `scaled` as they came), l (the local cumulative decay)
    [C, K] fp32, beta [C] -> T = (I + diag(beta) A_kk)^-1 and A_qk (j <= r, q scaled), [C, C] each in their refs'
    dtypes, zero above the diagonal.

    refs: with `scaled` the rows' inverse norms 1 / |q_r|, 1 / |k_r| ([C] each) first; then the per-token launch's
    diagonal tiles of A_kk and A_qk (`band`: [C, SUB] stacked, else whole [C, C] rows); then t_ref, aqk_ref.
    inverse: the precision of the inverse's products (`ChunkBlocks.inverse`). exp2: as in `_across_products`;
    one_loop: the products by `_across_products_joint`. with_qg: a last ref, qg_ref [C, K], for q e^G (q scaled;
    `ChunkBlocks.qg_in_pairs`; not with `scaled`)."""
    f32 = jnp.float32
    nb = q_ref.shape[0] // SUB
    if with_qg and scaled:
        raise ValueError("tile_solve_kernel: q e^G needs q normalised before the launch, not scaled in it")
    qg_ref, refs = (refs[-1], refs[:-1]) if with_qg else (None, refs)
    t_ref, aqk_ref = refs[-2:]
    norms, refs = (refs[:2], refs[2:]) if scaled else (None, refs)
    dkk_ref, dqk_ref = refs[:2]
    across = _across_products_joint if one_loop else _across_products
    akk, aqk = across(q_ref, k_ref, l_ref, scale=scale, key_slice=key_slice, exp2=exp2, qg_ref=qg_ref)
    if scaled:
        inverse_q, inverse_k = ([ref[_block(b)] for b in range(nb)] for ref in norms)
        for i, j in akk:
            akk[i, j] = akk[i, j] * (inverse_k[i][:, None] * inverse_k[j][None, :])
            aqk[i, j] = aqk[i, j] * (inverse_q[i][:, None] * inverse_k[j][None, :])

    diagonal = lambda ref, i: ref[_block(i), :] if band else ref[_block(i), _block(i)]
    zero = jnp.zeros((SUB, SUB), f32)
    for i in range(nb):              # A_qk stored first: its tiles are not held through the solve
        for j in range(nb):
            a = diagonal(dqk_ref, i) if i == j else aqk.get((i, j), zero)
            aqk_ref[_block(i), _block(j)] = a.astype(aqk_ref.dtype)

    rows = jnp.arange(SUB, dtype=jnp.int32)
    cols = rows[None, :]
    dot = _inverse_dot(inverse, interpret)
    inv = {}
    for i in range(nb):              # T by row blocks: row block i needs T's tiles of the rows above
        beta = b_ref[_block(i)].astype(f32)[:, None]
        inv[i, i] = doubling_inverse(jnp.where(rows[:, None] > cols, beta * diagonal(dkk_ref, i), 0.0), rows, cols,
                                     dot)
        for j in range(i - 1, -1, -1):
            acc = dot(beta * akk[i, j], inv[j, j])
            for m in range(j + 1, i):
                acc = acc + dot(beta * akk[i, m], inv[m, j])
            inv[i, j] = -dot(inv[i, i], acc)
        for j in range(nb):
            t_ref[_block(i), _block(j)] = inv.get((i, j), zero).astype(t_ref.dtype)
