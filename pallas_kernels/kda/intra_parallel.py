"""The intra-chunk KDA work without row-serial loops (`ChunkBlocks(intra="parallel")`, the default
for chunks of up to 64 tokens), in its original form three launches of one program per (row, head, chunk):
`local_cumsum_kernel`, `joint_pairs_kernel` (A_kk and A_qk; `decay_pairs_kernel` makes one of them
per launch with `pairs="separate"`), then `solve_kernel` (T = (I + A_kk)^-1, W, U, q e^G,
k e^(G_C - G), e^(G_C)): the same outputs as `chunk._intra_kernel`. By default (`pairs="diagonal"`,
`solve="sliced"`) the diagonal 16 x 16 blocks come from `intra_diagonal.py` first, one launch adds the pairs
across sub-blocks and ends with the inverse (by 16 x 16 tiles, `intra_solve_tiles.py`; or, with
`across="levels"`, the joint launch's levels across sub-blocks), and `sliced_factors_kernel` forms W, U, ...
one program per chunk (`factors_slice`, `factors_loop`; the per-token launch also writes the local cumsum,
`cumsum="diagonal"`; with `qg_in_pairs` the tile pairs launch writes q e^G instead): three launches. How the
levels forms work:

- The decay is taken as `local`: the cumulative log decay inside each 16-row sub-block (from the per-token
  launch, its own launch with `cumsum="pallas"`, or XLA's `local_cumsum` with `cumsum="xla"`). G of the
  chunk is local + the totals of the sub-blocks before. Every exponent below is a difference of two of these
  sums that is <= 0, so any gate (Kimi-Linear's unbounded one too) is safe.
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

Key slices and levels run as loops, not unrolled: unrolled, the compiler interleaved them and every
program held 255 registers and spilled 2-4 KB per thread (`benchmarks/triton_resources.py`).
Matrix products run on the matrix units: TF32 for the level products, as for the other kernels'
products of fp32 values; the inverse's TF32 x 3 (about fp32), or one TF32 product (`inverse="tf32"`,
as fla's solve), the default with bf16 factors.

Measured on the H200 (B = 1, T = 8192, K = V = 128, H = 32; RESULTS.md "KDA prefill: bf16 factors, one
launch for both pair matrices", run 5, bf16 factors, one-TF32 inverse, XLA's cumsum): pairs 680 us,
solve 561 us, the whole prefill 2.48 ms against the blocked form's 4.67 ms (fla 1.36 ms).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SUB = 16  # rows per run of the local cumulative decay (`local_cumsum`): keeps its sums small

# Matrix-product precision of the inverse's doubling steps, compiled (ChunkBlocks.inverse): "tf32x3", three
# TF32 products per product (about fp32 accuracy on the matrix units), or "tf32", one; interpret mode runs
# them in fp32.
INVERSE_PRECISION = {"tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                     "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32}


def local_cumsum(g_chunks):
    """[..., C, K] -> the inclusive cumulative sum inside each run of SUB rows, fp32 (C % SUB == 0)."""
    *lead, c, kd = g_chunks.shape
    parts = g_chunks.astype(jnp.float32).reshape(*lead, c // SUB, SUB, kd)
    return jnp.cumsum(parts, axis=-2).reshape(*lead, c, kd)


def local_cumsum_kernel(g_ref, l_ref):
    """`local_cumsum` of one chunk in a Pallas launch: g [C, K] -> l [C, K] fp32 (one read, one write;
    XLA runs the same sums as a windowed reduction)."""
    c = g_ref.shape[0]
    for i in range(c // SUB):
        rows = pl.ds(i * SUB, SUB)
        l_ref[rows, :] = jnp.cumsum(g_ref[rows, :].astype(jnp.float32), axis=0)


def _block_offsets(l_ref, ks, local, rows, nb):
    """local [C, ks] (columns ks of l_ref) -> (refrow [C, ks]: the decay of all sub-blocks before row r's,
    offsets: that at the start of each block and after the last, nb + 1 vectors [ks] (offsets[0] = 0)). A
    sub-block's total is its last row, read from l_ref: picked out of `local` it was a reduction across the
    program's threads (ptxas: 26 -> 16 barriers in the pairs kernel, 33 -> 19 in the solve)."""
    refrow = jnp.zeros_like(local)
    acc = jnp.zeros(local.shape[1:], jnp.float32)
    offsets = [acc]
    for b in range(nb):
        refrow = jnp.where((rows // SUB == b)[:, None], acc[None, :], refrow)
        acc = acc + l_ref[b * SUB + SUB - 1, ks]
        offsets.append(acc)
    return refrow, offsets


def _pick(rows_index, vectors):
    """[C, ks] whose row r is vectors[rows_index[r]] (a short static list of [ks] vectors)."""
    out = jnp.broadcast_to(vectors[0][None, :], (rows_index.shape[0], vectors[0].shape[0]))
    for i in range(1, len(vectors)):
        out = jnp.where((rows_index == i)[:, None], vectors[i][None, :], out)
    return out


def _slice(a_ref, k_ref, l_ref, i, key_slice, rows, nb, scale, norms=None):
    """Key slice i (of key_slice columns) of one chunk -> (its columns, a * scale, k (fp32), the
    local decay, its block offsets (refrow, offsets: see `_block_offsets`), G). norms: None, or refs of the
    rows' inverse norms (1 / |a_r|, 1 / |k_r|), [C] each, that a and k are scaled by (q and k not yet
    normalised; the W, U launch's "scales" hand-off), read a slice at a time."""
    ks = pl.ds(pl.multiple_of(i * key_slice, key_slice), key_slice)
    a = None if a_ref is None else a_ref[:, ks].astype(jnp.float32) * scale     # None: a not wanted
    k = k_ref[:, ks].astype(jnp.float32)
    if norms is not None:
        a = None if a is None else a * norms[0][...][:, None]
        k = k * norms[1][...][:, None]
    local = l_ref[:, ks]
    refrow, offsets = _block_offsets(l_ref, ks, local, rows, nb)
    return ks, a, k, local, refrow, offsets, local + refrow


def _level_factors(level, inside: bool, l_ref, ks, rows, local, refrow, offsets):
    """Row and column decay factors of level s = 2^level: every pair (r, j), j < r, whose indices
    first differ in the bit of s (r in the upper, j in the lower half of one 2s-row block) has
    e^(G_r - G_j) = x[r] * y[j] with x[r] = e^(G_r - G_a) and y[j] = e^(G_a - G_j), a the last row of
    j's half; both exponents <= 0. x is zero on lower-half rows, y on upper-half rows, so one
    exponential per entry serves both. `level` may be traced; `inside` (static): s < SUB, where the
    anchors are rows of `local` in the same sub-block (gathered), else sub-block boundaries, whose G
    is one of the offsets."""
    s = jnp.left_shift(jnp.int32(1), level)
    upper = ((jnp.right_shift(rows, level) & 1) == 1)[:, None]
    start = rows - (rows & (s - 1))            # first row of r's s-row half
    if inside:
        before = l_ref[jnp.maximum(start - 1, 0), ks]
        anchor_of_j = l_ref[start + s - 1, ks]
        x_exp, y_exp = local - before, anchor_of_j - local
    else:
        # Offsets against offsets first, then the local sums: G's full magnitude never enters.
        x_exp = local + (refrow - _pick(start // SUB, offsets))
        y_exp = (_pick((start + s) // SUB, offsets) - refrow) - local
    e = jnp.exp(jnp.where(upper, x_exp, y_exp))
    return jnp.where(upper, e, 0.0), jnp.where(upper, 0.0, e)


def _pair_levels(accs, accumulate, c, rows, cols, l_ref, ks, local, refrow, offsets, inside: bool = True):
    """`accs` after `accumulate(accs, x, y, same)` over every level of one key slice (the levels inside
    a sub-block unless `inside` is False, then across sub-blocks), each level a loop step so their tiles
    stay apart."""
    def level(lvl, accs, inside):
        x, y = _level_factors(lvl, inside, l_ref, ks, rows, local, refrow, offsets)
        same = jnp.right_shift(rows[:, None], lvl + 1) == jnp.right_shift(cols, lvl + 1)
        return accumulate(accs, x, y, same)

    inner = SUB.bit_length() - 1           # levels inside a sub-block: s = 1 .. SUB / 2
    if inside:
        accs = jax.lax.fori_loop(0, inner, functools.partial(level, inside=True), accs)
    return jax.lax.fori_loop(inner, c.bit_length() - 1, functools.partial(level, inside=False), accs)


def _dot_t(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def decay_pairs_kernel(left_ref, k_ref, l_ref, a_ref, *, scale: float, diagonal: bool, key_slice: int):
    """A[r, j] = sum_d left_r k_j e^(G_r - G_j) over j < r (j <= r when `diagonal`), one chunk.

    left/k [C, K] (left = q or k), l (local cumulative decay) [C, K] fp32 -> a [C, C] in a_ref's
    dtype, zero above the diagonal. The key slices run in a loop, one [C, C] accumulator live."""
    c, kd = k_ref.shape
    nb = c // SUB
    rows = jnp.arange(c, dtype=jnp.int32)
    cols = rows[None, :]

    def one_slice(i, acc):
        ks, left, k, local, refrow, offsets, _ = _slice(left_ref, k_ref, l_ref, i, key_slice, rows, nb, scale)
        if diagonal:
            acc = acc + jnp.where(rows[:, None] == cols, _dot_t(left, k), 0.0)
        add = lambda acc, x, y, same: acc + jnp.where(same, _dot_t(left * x, k * y), 0.0)
        return _pair_levels(acc, add, c, rows, cols, l_ref, ks, local, refrow, offsets)

    a_ref[...] = jax.lax.fori_loop(0, kd // key_slice, one_slice, jnp.zeros((c, c), jnp.float32)).astype(a_ref.dtype)


def band_blocks(band_ref, rows, cols):
    """A band [C, SUB] from `intra_diagonal.diagonal_pairs(band=True)` (row r's entry j of its sub-block at
    column j % SUB) -> the [C, C] matrix it stands for: its diagonal SUB x SUB blocks, zeros elsewhere.
    rows = arange(C), cols = rows[None, :]."""
    full = band_ref[rows[:, None], cols % SUB]
    return jnp.where(rows[:, None] // SUB == cols // SUB, full, 0.0)


def joint_pairs_kernel(q_ref, k_ref, l_ref, *refs, scale: float, key_slice: int, diagonal_given: bool = False,
                       band: bool = False, invert: str | None = None, scaled: bool = False, interpret: bool = False):
    """A_kk (j < r) and A_qk (j <= r, q scaled) of one chunk in one launch: each level's decay
    factors and k e^(G_a - G_j) are formed once for both. q/k [C, K], l [C, K] fp32 -> two [C, C].

    refs: (akk_ref, aqk_ref), with `diagonal_given` (dkk_ref, dqk_ref) first: the diagonal 16 x 16 blocks
    from `intra_diagonal.diagonal_pairs`, [C, C] fp32 (or with `band` [C, SUB]: `band_blocks`), to which only
    the levels across sub-blocks are added;
    with `scaled` (q and k not yet normalised) their rows' inverse norms, [C] each, before those: the levels
    run on q and k as they are and their sums are scaled by 1 / |q_r| (or 1 / |k_r|) and 1 / |k_j| at the end
    (one product an entry, and nothing more held across the loop);
    with `invert` (the inverse's precision, `ChunkBlocks.inverse`) b_ref [C] (beta) first of all, and
    akk_ref receives T = (I + diag(beta) A_kk)^-1 in its dtype instead of A_kk."""
    c, kd = k_ref.shape
    nb = c // SUB
    rows = jnp.arange(c, dtype=jnp.int32)
    cols = rows[None, :]
    akk_ref, aqk_ref = refs[-2:]
    if invert:
        b_ref, refs = refs[0], refs[1:]
    if scaled:
        norms, refs = refs[:2], refs[2:]

    def one_slice(i, accs):
        akk, aqk = accs
        ks, q, k, local, refrow, offsets, _ = _slice(q_ref, k_ref, l_ref, i, key_slice, rows, nb, scale)
        if not diagonal_given:
            aqk = aqk + jnp.where(rows[:, None] == cols, _dot_t(q, k), 0.0)

        def add(accs, x, y, same):
            ky = k * y
            return (accs[0] + jnp.where(same, _dot_t(k * x, ky), 0.0),
                    accs[1] + jnp.where(same, _dot_t(q * x, ky), 0.0))
        return _pair_levels((akk, aqk), add, c, rows, cols, l_ref, ks, local, refrow, offsets,
                            inside=not diagonal_given)

    zeros = (jnp.zeros((c, c), jnp.float32),) * 2

    def given():     # the per-token launch's diagonal blocks, or nothing
        if not diagonal_given:
            return zeros
        return tuple(band_blocks(r, rows, cols) if band else r[...] for r in refs[:2])

    akk, aqk = jax.lax.fori_loop(0, kd // key_slice, one_slice, zeros if scaled else given())
    if scaled:
        inverse_q, inverse_k = (r[...] for r in norms)
        akk_d, aqk_d = given()
        akk = akk_d + akk * (inverse_k[:, None] * inverse_k[None, :])
        aqk = aqk_d + aqk * (inverse_q[:, None] * inverse_k[None, :])
    aqk_ref[...] = aqk.astype(aqk_ref.dtype)
    if invert:
        lower = jnp.where(rows[:, None] > cols, akk * b_ref[...].astype(jnp.float32)[:, None], 0.0)
        akk = doubling_inverse(lower, rows, cols, _inverse_dot(invert, interpret))
    akk_ref[...] = akk.astype(akk_ref.dtype)


def doubling_inverse(strict_lower, rows, cols, dot_inv):
    """(I + L)^-1 of a strictly lower [n, n] L by doubling (n a power of two): with T_s the block-diagonal
    inverse of the s x s diagonal blocks, T_2s = T_s - T_s L_s T_s, L_s being L's lower-left s x s block in
    each 2s x 2s diagonal block. rows = arange(n), cols = rows[None, :]; dot_inv: the products' precision."""
    lower_left = lambda s: (((rows[:, None] // (2 * s)) == (cols // (2 * s)))
                            & ((rows[:, None] // s) % 2 == 1) & ((cols // s) % 2 == 0))
    t = jnp.where(rows[:, None] == cols, 1.0, 0.0) - jnp.where(lower_left(1), strict_lower, 0.0)
    s = 2
    while s < rows.shape[0]:
        t = t - dot_inv(dot_inv(t, jnp.where(lower_left(s), strict_lower, 0.0)), t)
        s *= 2
    return t


def _inverse_dot(inverse: str, interpret: bool):
    """The matrix product of the inverse's doubling steps at the precision `inverse` names (fp32 in
    interpret mode)."""
    precise = jax.lax.Precision.HIGHEST if interpret else INVERSE_PRECISION[inverse]
    return lambda a, b: jnp.dot(a, b, precision=precise, preferred_element_type=jnp.float32)


def _key_factors(i, t, beta, q_ref, k_ref, l_ref, w_ref, qg_ref, kt_ref, dec_ref, *, scale: float, key_slice: int,
                 norms=None):
    """Key slice i of one chunk's W = T diag(beta) (e^G k), q e^G, k e^(G_C - G) and e^(G_C); t [C, C]
    (fp32, or bf16: then the product's other operand is rounded to bf16 too). norms: see `_slice`. q_ref and
    qg_ref None: no q e^G (the tile pairs launch writes it, `ChunkBlocks.qg_in_pairs`)."""
    c = k_ref.shape[0]
    rows = jnp.arange(c, dtype=jnp.int32)
    ks, q, k, _, _, offsets, g_chunk = _slice(q_ref, k_ref, l_ref, i, key_slice, rows, c // SUB, scale, norms)
    last = offsets[-1]
    e_g = jnp.exp(g_chunk)
    x = (beta[:, None] * e_g * k).astype(t.dtype)
    w_ref[:, ks] = jnp.dot(t, x, preferred_element_type=jnp.float32).astype(w_ref.dtype)
    if qg_ref is not None:
        qg_ref[:, ks] = (q * e_g).astype(qg_ref.dtype)
    kt_ref[:, ks] = (k * jnp.exp(last[None, :] - g_chunk)).astype(kt_ref.dtype)
    dec_ref[ks] = jnp.exp(last)


def _value_factors(i, t, beta, v_ref, u_ref, *, value_slice: int):
    """Value slice i of one chunk's U = T diag(beta) v."""
    vs = pl.ds(pl.multiple_of(i * value_slice, value_slice), value_slice)
    y = (beta[:, None] * v_ref[:, vs].astype(jnp.float32)).astype(t.dtype)
    u_ref[:, vs] = jnp.dot(t, y, preferred_element_type=jnp.float32).astype(u_ref.dtype)


def solve_kernel(akk_ref, q_ref, k_ref, v_ref, l_ref, b_ref, w_ref, u_ref, qg_ref, kt_ref, dec_ref, *, scale: float,
                 key_slice: int, value_slice: int, inverse: str, interpret: bool):
    """One chunk: T = (I + diag(beta) A_kk)^-1 by doubling, then W = T diag(beta) (e^G k),
    U = T diag(beta) v, q e^G, k e^(G_C - G) and e^(G_C). akk [C, C] fp32 from `joint_pairs_kernel`
    (or `decay_pairs_kernel`)."""
    c, kd = q_ref.shape
    vd = v_ref.shape[1]
    rows = jnp.arange(c, dtype=jnp.int32)
    cols = rows[None, :]
    beta = b_ref[...].astype(jnp.float32)
    akk = jnp.where(rows[:, None] > cols, akk_ref[...] * beta[:, None], 0.0)
    t = doubling_inverse(akk, rows, cols, _inverse_dot(inverse, interpret))

    def key_part(i, carry):
        _key_factors(i, t, beta, q_ref, k_ref, l_ref, w_ref, qg_ref, kt_ref, dec_ref, scale=scale,
                     key_slice=key_slice)
        return carry

    def value_part(i, carry):
        _value_factors(i, t, beta, v_ref, u_ref, value_slice=value_slice)
        return carry

    jax.lax.fori_loop(0, kd // key_slice, key_part, 0)
    jax.lax.fori_loop(0, vd // value_slice, value_part, 0)


def sliced_factors_kernel(t_ref, q_ref, k_ref, v_ref, l_ref, b_ref, *refs, scale: float, key_slice: int,
                          value_slice: int, scaled: bool = False, loop: bool = False, with_qg: bool = True):
    """`solve_kernel` after the inverse (`ChunkBlocks(solve="sliced")`): program (row, head, chunk, i) takes
    T [C, C] (from `joint_pairs_kernel` with `invert` set, in the factors' dtype) and writes key slice i of W,
    q e^G, k e^(G_C - G), e^(G_C) and value slice i of U (where the chunk has that many); with `loop` one program
    a chunk walks every slice i in a loop (whose loads the compiler can pipeline: `num_stages`). refs: with
    `scaled` (q and k not yet normalised) their rows' inverse norms, [C] each, then the outputs w, u, qg, kt,
    dec. Without `with_qg` q_ref is None and the outputs w, u, kt, dec (`ChunkBlocks.qg_in_pairs`)."""
    t = t_ref[...]
    beta = b_ref[...].astype(jnp.float32)
    norms = refs[:2] if scaled else None
    outs = refs[2 * scaled:]
    w_ref, u_ref, qg_ref, kt_ref, dec_ref = outs if with_qg else (outs[0], outs[1], None, *outs[2:])
    key_slices, value_slices = k_ref.shape[1] // key_slice, v_ref.shape[1] // value_slice

    def one_slice(i):
        def key():
            _key_factors(i, t, beta, q_ref, k_ref, l_ref, w_ref, qg_ref, kt_ref, dec_ref, scale=scale,
                         key_slice=key_slice, norms=norms)

        def value():
            _value_factors(i, t, beta, v_ref, u_ref, value_slice=value_slice)

        if key_slices == value_slices:     # no branches (a loop's loads inside one are not pipelined)
            key()
            value()
        else:
            pl.when(i < key_slices)(key)
            pl.when(i < value_slices)(value)

    def loop_step(i, carry):
        one_slice(i)
        return carry

    if loop:
        jax.lax.fori_loop(0, max(key_slices, value_slices), loop_step, 0)
    else:
        one_slice(pl.program_id(3))
