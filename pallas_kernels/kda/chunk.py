"""Chunked KDA prefill in Pallas kernels (Triton lowering). Twins: `chunk_xla.kda_chunk_xla`
and `reference.kda_recurrent_reference`.

1. `_intra_kernel`, grid (row, head, chunk), all chunks in parallel: cumulative decay G, the
   pairwise-decayed key-key and query-key matrices (every exponent is G_r - G_j with j <= r, so
   <= 0: no overflow for any gate), T = (I + L)^-1 by forward substitution, and the WY factors
   W = T diag(beta) (e^G * K), U = T diag(beta) V, plus q e^G, k e^(G_C - G) and e^(G_C).
2. `_inter_kernel`, grid (row, head, value block), sequential over chunks with the fp32 state
   block in registers: N = U - W S; O = (q e^G) S + A_qk N; S = e^(G_C) * S + (k e^(G_C - G))^T N.
   Value columns of the state evolve independently, so they split across programs.

`ChunkBlocks` selects the forms of each step: `intra="parallel"` (`intra_parallel.py` and
`intra_diagonal.py`, three launches without row-serial loops by default; the default up to 64-token chunks)
or "blocked" / "column" (the kernel above in two forms); `factors`, the dtype of W, U, A_qk, q e^G and
k e^(G_C - G) between the passes (bf16 for bf16 values by default); `inter="split"` (`inter_split.py`, a
state-only pass, then the outputs of all chunks at once).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret, is_pow2, multiprocessor_count
from pallas_kernels.kda.inter_split import chunk_inter_split
from pallas_kernels.kda.gate import l2_normalize
from pallas_kernels.kda.intra_diagonal import IN_LAUNCH_NORMS, diagonal_pairs
from pallas_kernels.kda.intra_solve_tiles import tile_solve_kernel
from pallas_kernels.kda.intra_tiles import tile_pairs_kernel
from pallas_kernels.kda.intra_parallel import (SUB, decay_pairs_kernel, joint_pairs_kernel, local_cumsum,
                                              local_cumsum_kernel, sliced_factors_kernel, solve_kernel)
from pallas_kernels.kda.reference import validate_inputs
from pallas_kernels.kda.tuning import PARALLEL_MAX_CHUNK, ChunkBlocks


def _pairwise_decayed(k, q, cum, rows):
    """A_kk[r, j] = sum_d k_r k_j e^(G_r - G_j) and A_qk[r, j] = sum_d q_r k_j e^(G_r - G_j) for j <= r
    (zero above the diagonal), built one column j at a time so every exponent is <= 0.

    k, q, cum: [C, K] fp32 (cum = inclusive cumulative decay G); rows = arange(C). -> two [C, C].
    """
    def column(j, carry):
        akk, aqk = carry
        pick = (rows == j)[:, None]
        k_j = jnp.sum(jnp.where(pick, k, 0.0), axis=0)
        g_j = jnp.sum(jnp.where(pick, cum, 0.0), axis=0)
        kd = k_j[None, :] * jnp.exp(jnp.where(rows[:, None] >= j, cum - g_j[None, :], -jnp.inf))
        put = (rows == j)[None, :]
        return (jnp.where(put, jnp.sum(k * kd, axis=1)[:, None], akk),
                jnp.where(put, jnp.sum(q * kd, axis=1)[:, None], aqk))

    c = rows.shape[0]
    zeros = jnp.zeros((c, c), jnp.float32)
    return jax.lax.fori_loop(0, c, column, (zeros, zeros))


def _inv_unit_lower(strict_lower, rows):
    """(I + L)^-1 for a small strictly lower-triangular L, by forward substitution (row by row)."""
    def row(i, t):
        pick = (rows == i)[:, None]
        l_i = jnp.sum(jnp.where(pick, strict_lower, 0.0), axis=0)
        t_i = jnp.where(rows == i, 1.0, 0.0) - jnp.sum(l_i[:, None] * t, axis=0)
        return jnp.where(pick, t_i[None, :], t)
    n = strict_lower.shape[0]
    return jax.lax.fori_loop(0, n, row, jnp.zeros((n, n), jnp.float32))


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, *, scale):
    f32 = jnp.float32
    q = q_ref[...].astype(f32) * scale                   # [C, K]
    k = k_ref[...].astype(f32)
    v = v_ref[...].astype(f32)                           # [C, V]
    beta = b_ref[...].astype(f32)                        # [C]
    cum = jnp.cumsum(g_ref[...].astype(f32), axis=0)     # G_r
    c = q.shape[0]
    rows = jnp.arange(c)
    akk, aqk = _pairwise_decayed(k, q, cum, rows)
    akk = jnp.where(rows[:, None] > rows[None, :], akk * beta[:, None], 0.0)
    tri = _inv_unit_lower(akk, rows)
    e_cum = jnp.exp(cum)
    last = jnp.sum(jnp.where((rows == c - 1)[:, None], cum, 0.0), axis=0)
    w_ref[...] = jnp.dot(tri, beta[:, None] * e_cum * k, preferred_element_type=f32).astype(w_ref.dtype)
    u_ref[...] = jnp.dot(tri, beta[:, None] * v, preferred_element_type=f32).astype(u_ref.dtype)
    aqk_ref[...] = aqk.astype(aqk_ref.dtype)
    qg_ref[...] = (q * e_cum).astype(qg_ref.dtype)
    kt_ref[...] = (k * jnp.exp(last[None, :] - cum)).astype(kt_ref.dtype)
    dec_ref[...] = jnp.exp(last)


def _intra_blocked_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, *,
                          scale, sub):
    """Same outputs as `_intra_kernel`, with the chunk split into sub-blocks of `sub` rows:
    off-diagonal blocks of A_kk / A_qk are matrix products against a reference point at the
    start of the row block (G_r - G_ref <= 0 and G_ref - G_j <= 0, so both factors are <= 1);
    only the diagonal blocks use pairwise exponent differences. (I + L)^-1 is assembled from
    the inverted diagonal blocks by block forward substitution."""
    f32 = jnp.float32
    c, kdim = q_ref.shape
    nb = c // sub
    rows = jnp.arange(sub)
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=f32)
    blk = lambda i: pl.ds(i * sub, sub)

    cums, refs = [], []
    prev = jnp.zeros((kdim,), f32)
    for i in range(nb):
        cum = jnp.cumsum(g_ref[blk(i), :].astype(f32), axis=0) + prev[None, :]
        cums.append(cum)
        refs.append(prev)
        prev = jnp.sum(jnp.where((rows == sub - 1)[:, None], cum, 0.0), axis=0)
    last = prev

    akk = [[None] * nb for _ in range(nb)]
    for i in range(nb):
        k_i = k_ref[blk(i), :].astype(f32)
        q_i = q_ref[blk(i), :].astype(f32) * scale
        b_i = b_ref[blk(i)].astype(f32)
        down = jnp.exp(cums[i] - refs[i][None, :])
        for j in range(i):
            k_j = k_ref[blk(j), :].astype(f32) * jnp.exp(refs[i][None, :] - cums[j])
            akk[i][j] = dot(k_i * down, k_j.T) * b_i[:, None]
            aqk_ref[blk(i), blk(j)] = dot(q_i * down, k_j.T).astype(aqk_ref.dtype)
        dkk, dqk = _pairwise_decayed(k_i, q_i, cums[i], rows)
        akk[i][i] = jnp.where(rows[:, None] > rows[None, :], dkk * b_i[:, None], 0.0)
        aqk_ref[blk(i), blk(i)] = dqk.astype(aqk_ref.dtype)
        for j in range(i + 1, nb):
            aqk_ref[blk(i), blk(j)] = jnp.zeros((sub, sub), aqk_ref.dtype)
        qg_ref[blk(i), :] = (q_i * jnp.exp(cums[i])).astype(qg_ref.dtype)
        kt_ref[blk(i), :] = (k_i * jnp.exp(last[None, :] - cums[i])).astype(kt_ref.dtype)

    inv = [[None] * nb for _ in range(nb)]
    for i in range(nb):
        inv[i][i] = _inv_unit_lower(akk[i][i], rows)
        for j in range(i):
            acc = dot(akk[i][j], inv[j][j])
            for m in range(j + 1, i):
                acc += dot(akk[i][m], inv[m][j])
            inv[i][j] = -dot(inv[i][i], acc)
    for i in range(nb):
        w_i = u_i = None
        for j in range(i + 1):
            b_j = b_ref[blk(j)].astype(f32)[:, None]
            x_j = b_j * jnp.exp(cums[j]) * k_ref[blk(j), :].astype(f32)
            y_j = b_j * v_ref[blk(j), :].astype(f32)
            w_i = dot(inv[i][j], x_j) if w_i is None else w_i + dot(inv[i][j], x_j)
            u_i = dot(inv[i][j], y_j) if u_i is None else u_i + dot(inv[i][j], y_j)
        w_ref[blk(i), :] = w_i.astype(w_ref.dtype)
        u_ref[blk(i), :] = u_i.astype(u_ref.dtype)
    dec_ref[...] = jnp.exp(last)


def _chunk_step(n, s, w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, o_ref):
    """One chunk of the sequential pass: writes its output block, returns the state after it.
    With bf16 factors (ChunkBlocks.factors) the products take the state and N rounded to bf16 and
    sum in fp32; the state itself stays fp32."""
    f32 = jnp.float32
    w, qg, kt = w_ref[n], qg_ref[n], kt_ref[n]            # [C, K]
    dot = lambda a, b: jnp.dot(a, b.astype(a.dtype), preferred_element_type=f32)
    nu = u_ref[n].astype(f32) - dot(w, s)                                              # [C, Vb]
    o = dot(qg, s) + dot(aqk_ref[n], nu)
    o_ref[n] = o.astype(o_ref.dtype)
    return dec_ref[n][:, None] * s + dot(kt.T, nu)


def _inter_kernel(w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, s0_ref, o_ref, s_ref, *, n_chunks):
    refs = (w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, o_ref)
    s_ref[...] = jax.lax.fori_loop(0, n_chunks, lambda n, s: _chunk_step(n, s, *refs), s0_ref[...].astype(jnp.float32))


def _inter_varlen_kernel(first_ref, last_ref, w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, s0_ref, o_ref, s_ref, *,
                         n_chunks):
    """`_inter_kernel` over chunks of several sequences in a row: chunk n starts sequence first[n]
    (its state is that sequence's initial state) and ends sequence last[n] (the state after it is that
    sequence's final state); -1 where none. s0 / s: [S, K, Vb]."""
    refs = (w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, o_ref)

    def step(n, s):
        start, end = first_ref[n], last_ref[n]
        s = jax.lax.cond(start >= 0, lambda: s0_ref[jnp.maximum(start, 0)].astype(jnp.float32), lambda: s)
        s = _chunk_step(n, s, *refs)

        @pl.when(end >= 0)
        def _():
            s_ref[end] = s
        return s

    jax.lax.fori_loop(0, n_chunks, step, jnp.zeros(s0_ref.shape[1:], jnp.float32))


def _require_settled(name: str, blocks: ChunkBlocks) -> None:
    if "auto" in (blocks.intra, blocks.factors, blocks.inverse, blocks.solve, blocks.cumsum, blocks.across,
                  blocks.qk_norm):
        raise ValueError(f"{name}: ChunkBlocks has 'auto' fields; pass blocks.resolve(value dtype)")


def chunk_intra(qc, kc, vc, gc, bc, *, scale: float, blocks: ChunkBlocks, interpret: bool, tokens: bool = False,
                normalize: bool = False):
    """Kernel 1 on chunked inputs [B, H, N, C, ...] (with `tokens`: [B, N, C, H, ...], the caller's
    layout with its time axis split, "parallel" only) -> (W, U, A_qk, q e^G, k e^(G_C - G), e^(G_C)),
    each [B, H, N, C, ...]. blocks: settled (`ChunkBlocks.resolve`). normalize: q and k are not yet
    L2-normalised; the per-token launch does it (`blocks.normalizes_qk` only)."""
    _require_settled("chunk_intra", blocks)
    if normalize and not blocks.normalizes_qk:
        raise ValueError(f"chunk_intra: q and k are L2-normalised inside the per-token launch of intra='parallel' "
                         f"with pairs='diagonal' and a qk_norm other than 'xla' only (the 'scales' forms with "
                         f"solve='sliced'), got intra={blocks.intra!r}, pairs={blocks.pairs!r}, "
                         f"solve={blocks.solve!r}, qk_norm={blocks.qk_norm!r}")
    if tokens:
        if not blocks.reads_tokens:
            raise ValueError("chunk_intra: inputs in the tokens layout need layout='tokens', the 'parallel' form, "
                             "a cumsum other than XLA's and the fused pass")
        return _intra_parallel(qc, kc, vc, gc, bc, scale=scale, blocks=blocks, interpret=interpret, tokens=True,
                               normalize=normalize)
    b, h, n, c, kd = qc.shape
    vd = vc.shape[-1]
    f32 = jnp.float32
    if blocks.intra == "parallel":
        return _intra_parallel(qc, kc, vc, gc, bc, scale=scale, blocks=blocks, interpret=interpret,
                               normalize=normalize)
    if blocks.intra == "blocked":
        intra = functools.partial(_intra_blocked_kernel, scale=scale, sub=blocks.sub_chunk)
    else:
        intra = functools.partial(_intra_kernel, scale=scale)
    blk = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda i, j, m: (i, j, m) + (0,) * len(tail))
    fd = jnp.dtype(blocks.factors)
    return pl.pallas_call(
        intra,
        grid=(b, h, n),
        in_specs=[blk(c, kd), blk(c, kd), blk(c, vd), blk(c, kd), blk(c)],
        out_specs=[blk(c, kd), blk(c, vd), blk(c, c), blk(c, kd), blk(c, kd), blk(kd)],
        out_shape=[jax.ShapeDtypeStruct((b, h, n, c, kd), fd), jax.ShapeDtypeStruct((b, h, n, c, vd), fd),
                   jax.ShapeDtypeStruct((b, h, n, c, c), fd), jax.ShapeDtypeStruct((b, h, n, c, kd), fd),
                   jax.ShapeDtypeStruct((b, h, n, c, kd), fd), jax.ShapeDtypeStruct((b, h, n, kd), f32)],
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="kda_chunk_intra",
    )(qc, kc, vc, gc, bc)


def _intra_parallel(qc, kc, vc, gc, bc, *, scale: float, blocks: ChunkBlocks, interpret: bool, tokens: bool = False,
                    normalize: bool = False):
    """`chunk_intra` as three or four launches (`intra_parallel.py`): the local cumsum (a launch, XLA's, or none
    with cumsum="diagonal"), A_kk and A_qk (one launch, or one each with blocks.pairs = "separate", or by 16-row
    tiles with "tiles": `intra_tiles.py`, or the diagonal blocks one program per token first with "diagonal":
    `intra_diagonal.py`, after which one launch forms the pairs across sub-blocks and the inverse: by 16 x 16
    tiles, `intra_solve_tiles.py`, or by levels and doubling), then the solve and factors (q e^G among them, or
    with qg_in_pairs from the tile pairs launch). tokens: the raw inputs
    are [B, N, C, H, ...] and each program reads its chunk's [C, ...] rows of one head there. normalize: q and k
    not yet L2-normalised; the per-token launch normalises them and hands them on (or their inverse norms, with
    the "scales" forms)."""
    if tokens:
        b, n, c, h, kd = qc.shape
    else:
        b, h, n, c, kd = qc.shape
    vd = vc.shape[-1]
    f32 = jnp.float32
    key_slice, value_slice = min(kd, blocks.key_slice), min(vd, blocks.key_slice)
    blk = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda i, j, m: (i, j, m) + (0,) * len(tail))
    # the raw inputs' blocks: grid (b, h, n) -> rows [n C, (n + 1) C) of head h
    raw = (lambda *tail: pl.BlockSpec((None, None, c, None) + tail, lambda i, j, m: (i, m, 0, j) + (0,) * len(tail))
           ) if tokens else (lambda *tail: blk(c, *tail))
    params = plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    pair_warps, pair_stages, pair_slice = blocks.pairs_launch()
    pair_params = plt.CompilerParams(num_warps=pair_warps, num_stages=pair_stages)
    pair_slice = min(kd, pair_slice)
    if blocks.cumsum == "pallas":
        lc = pl.pallas_call(local_cumsum_kernel, grid=(b, h, n), in_specs=[raw(kd)], out_specs=blk(c, kd),
                            out_shape=jax.ShapeDtypeStruct((b, h, n, c, kd), f32), compiler_params=params,
                            interpret=interpret, name="kda_chunk_local_cumsum")(gc)
    elif blocks.cumsum == "xla":
        lc = local_cumsum(gc)
    else:
        lc = None     # "diagonal": the per-token launch below writes it

    fd = jnp.dtype(blocks.factors)     # A_kk stays fp32: the inverse is taken of it

    def pairs(left, left_scale, diagonal, dtype, name):
        return pl.pallas_call(
            functools.partial(decay_pairs_kernel, scale=left_scale, diagonal=diagonal, key_slice=pair_slice),
            grid=(b, h, n), in_specs=[raw(kd), raw(kd), blk(c, kd)], out_specs=blk(c, c),
            out_shape=jax.ShapeDtypeStruct((b, h, n, c, c), dtype), compiler_params=pair_params, interpret=interpret,
            name=name)(left, kc, lc)

    sliced = blocks.solve == "sliced"     # the inverse inside the pairs launch, then W, U, ... by slices
    joint_out = [jax.ShapeDtypeStruct((b, h, n, c, c), fd if sliced else f32),
                 jax.ShapeDtypeStruct((b, h, n, c, c), fd)]
    norms = ()     # 1 / |q|, 1 / |k| per row where the per-token launch hands on those instead of q and k
    if blocks.pairs in ("joint", "diagonal"):
        given = blocks.pairs == "diagonal"
        extra = (bc,) if sliced else ()
        if given:
            per, warps = blocks.diagonal_launch(h, tokens)
            akk_d, aqk_d, *rest = diagonal_pairs(qc, kc, gc, scale=scale, tokens=tokens, heads=per,
                                                 num_warps=warps, interpret=interpret, cumsum=lc is None,
                                                 band=blocks.diagonal_band,
                                                 normalize=blocks.qk_norm if normalize else None,
                                                 exp2=blocks.diagonal_exp2)
            if normalize and blocks.hands_on_norms:
                norms = tuple(rest[-2:])
            elif normalize:
                qc, kc = rest[-2:]
            extra += norms + (akk_d, aqk_d)
            lc = rest[0] if lc is None else lc
        if blocks.across == "tiles":      # check_blocks: with pairs="diagonal" and solve="sliced" only
            kernel = functools.partial(tile_solve_kernel, scale=scale, key_slice=pair_slice, band=blocks.diagonal_band,
                                       inverse=blocks.inverse, scaled=bool(norms), exp2=blocks.pairs_exp2,
                                       one_loop=blocks.pairs_one_loop, with_qg=blocks.qg_in_pairs,
                                       interpret=interpret)
        else:
            kernel = functools.partial(joint_pairs_kernel, scale=scale, key_slice=pair_slice, diagonal_given=given,
                                       band=blocks.diagonal_band, invert=blocks.inverse if sliced else None,
                                       scaled=bool(norms), interpret=interpret)
        qg_out = [jax.ShapeDtypeStruct((b, h, n, c, kd), fd)] if blocks.qg_in_pairs else []   # q e^G
        akk, aqk, *qg_pairs = pl.pallas_call(
            kernel,
            grid=(b, h, n),
            in_specs=[raw(kd), raw(kd), blk(c, kd)] + [raw()] * (sliced + len(norms))
                     + [blk(c, SUB if blocks.diagonal_band else c)] * (2 * given),
            out_specs=[blk(c, c)] * 2 + [blk(c, kd)] * len(qg_out), out_shape=joint_out + qg_out,
            compiler_params=pair_params, interpret=interpret, name="kda_chunk_pairs")(qc, kc, lc, *extra)
    elif blocks.pairs == "tiles":
        akk, aqk = pl.pallas_call(
            functools.partial(tile_pairs_kernel, scale=scale, key_slice=pair_slice),
            grid=(b, h, n), in_specs=[raw(kd), raw(kd), blk(c, kd)], out_specs=[blk(c, c)] * 2,
            out_shape=joint_out, compiler_params=pair_params, interpret=interpret, name="kda_chunk_pairs")(qc, kc, lc)
    else:
        akk = pairs(kc, 1.0, False, f32, "kda_chunk_akk")
        aqk = pairs(qc, scale, True, fd, "kda_chunk_aqk")
    factor_shapes = [jax.ShapeDtypeStruct((b, h, n, c, kd), fd), jax.ShapeDtypeStruct((b, h, n, c, vd), fd),
                     jax.ShapeDtypeStruct((b, h, n, c, kd), fd), jax.ShapeDtypeStruct((b, h, n, c, kd), fd),
                     jax.ShapeDtypeStruct((b, h, n, kd), f32)]
    if sliced:
        fslice = blocks.factors_slice or blocks.key_slice
        key_slice, value_slice = min(kd, fslice), min(vd, fslice)
        factor_warps, factor_stages = blocks.factors_launch()
        params = plt.CompilerParams(num_warps=factor_warps, num_stages=factor_stages)
        grid4 = lambda spec: pl.BlockSpec(spec.block_shape, lambda i, j, m, s: spec.index_map(i, j, m))
        ins = [blk(c, c), raw(kd), raw(kd), raw(vd), blk(c, kd), raw()] + [raw()] * len(norms)
        outs = [blk(c, kd), blk(c, vd), blk(c, kd), blk(c, kd), blk(kd)]
        loop = blocks.factors_loop
        kernel = functools.partial(sliced_factors_kernel, scale=scale, key_slice=key_slice, value_slice=value_slice,
                                   scaled=bool(norms), loop=loop)
        args = [akk, qc, kc, vc, lc, bc, *norms]
        if blocks.qg_in_pairs:            # q e^G came from the pairs launch: no q in, no q e^G out
            kernel = functools.partial(lambda t, *rest, fn: fn(t, None, *rest, with_qg=False), fn=kernel)
            del ins[1], outs[2], factor_shapes[2], args[1]
        *head, kt, dec = pl.pallas_call(
            kernel,
            grid=(b, h, n, 1 if loop else max(kd // key_slice, vd // value_slice)),
            in_specs=[grid4(x) for x in ins], out_specs=[grid4(x) for x in outs], out_shape=factor_shapes,
            compiler_params=params, interpret=interpret, name="kda_chunk_factors",
        )(*args)
        w, u, qg = head if not blocks.qg_in_pairs else (*head, qg_pairs[0])
        return w, u, aqk, qg, kt, dec
    w, u, qg, kt, dec = pl.pallas_call(
        functools.partial(solve_kernel, scale=scale,
                          key_slice=key_slice, value_slice=value_slice,
                          inverse=blocks.inverse, interpret=interpret),
        grid=(b, h, n),
        in_specs=[blk(c, c), raw(kd), raw(kd), raw(vd), blk(c, kd), raw()],
        out_specs=[blk(c, kd), blk(c, vd), blk(c, kd), blk(c, kd), blk(kd)],
        out_shape=factor_shapes,
        compiler_params=params, interpret=interpret, name="kda_chunk_solve",
    )(akk, qc, kc, vc, lc, bc)
    return w, u, aqk, qg, kt, dec


def chunk_inter(w, u, aqk, qg, kt, dec, s0, *, out_dtype, blocks: ChunkBlocks, interpret: bool, bounds=None,
                tokens: bool = False):
    """Kernel 2: the sequential pass over chunks -> (o [B, H, N, C, V] (with `tokens`: [B, N, C, H, V],
    the caller's layout), final state [B, H, K, V]).

    `bounds` = (first [N], last [N]) int32 for B = 1 rows holding several sequences (see
    `_inter_varlen_kernel`); then s0 and the returned states are per sequence, [S, H, K, V].
    blocks: settled (`ChunkBlocks.resolve`)."""
    _require_settled("chunk_inter", blocks)
    if tokens and not blocks.reads_tokens:
        raise ValueError("chunk_inter: outputs in the tokens layout need layout='tokens', the 'parallel' form, the "
                         "cumsum other than XLA's and the fused pass")
    if blocks.inter == "split":
        if bounds is not None:
            raise ValueError("chunk_inter: rows of several sequences support inter='fused' only")
        if w.dtype != jnp.float32:
            raise ValueError(f"chunk_inter: inter='split' takes fp32 factors, got {w.dtype}")
        return chunk_inter_split(w, u, aqk, qg, kt, dec, s0, out_dtype=out_dtype, value_block=blocks.value_block,
                                 num_warps=blocks.inter_num_warps,
                                 num_stages=blocks.inter_num_stages or blocks.num_stages, interpret=interpret)
    b, h, n, c, kd = w.shape
    vd = u.shape[-1]
    vb = min(vd, blocks.value_block)
    # one chunk's loads of a program: W, q e^G, k e^(G_C - G) [C, K], U [C, Vb], A_qk [C, C], e^(G_C) [K]
    stage_bytes = w.dtype.itemsize * (3 * c * kd + c * vb + c * c) + 4 * kd
    stages = blocks.sequential_stages(b * h * (vd // vb), multiprocessor_count(), stage_bytes)
    whole = lambda *tail: pl.BlockSpec((None, None) + tail, lambda i, j, m: (i, j) + (0,) * len(tail))
    by_value = lambda *tail: pl.BlockSpec((None, None) + tail[:-1] + (vb,),
                                          lambda i, j, m: (i, j) + (0,) * (len(tail) - 1) + (m,))
    chunk_specs = [whole(n, c, kd), by_value(n, c, vd), whole(n, c, c), whole(n, c, kd), whole(n, c, kd), whole(n, kd)]
    if bounds is None:
        kernel, flags, state_spec = functools.partial(_inter_kernel, n_chunks=n), (), by_value(kd, vd)
        state_shape, flag_specs = (b, h, kd, vd), []
    else:
        kernel, flags = functools.partial(_inter_varlen_kernel, n_chunks=n), bounds
        seqs = s0.shape[0]
        state_spec = pl.BlockSpec((seqs, None, kd, vb), lambda i, j, m: (0, j, 0, m))
        state_shape, flag_specs = (seqs, h, kd, vd), [pl.BlockSpec((n,), lambda i, j, m: (0,))] * 2
    if tokens:
        if bounds is not None:
            raise ValueError("chunk_inter: rows of several sequences write the chunked layout only")
        out_spec = pl.BlockSpec((None, n, c, None, vb), lambda i, j, m: (i, 0, 0, j, m))
        out_shape = jax.ShapeDtypeStruct((b, n, c, h, vd), out_dtype)
    else:
        out_spec, out_shape = by_value(n, c, vd), jax.ShapeDtypeStruct((b, h, n, c, vd), out_dtype)
    return pl.pallas_call(
        kernel,
        grid=(b, h, vd // vb),
        in_specs=flag_specs + chunk_specs + [state_spec],
        out_specs=[out_spec, state_spec],
        out_shape=[out_shape, jax.ShapeDtypeStruct(state_shape, jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=blocks.inter_num_warps, num_stages=stages),
        interpret=interpret,
        name="kda_chunk_inter",
    )(*flags, w, u, aqk, qg, kt, dec, s0)


def check_blocks(name: str, kd: int, vd: int, blocks: ChunkBlocks) -> None:
    c = blocks.chunk
    sub = SUB if blocks.intra == "parallel" else blocks.sub_chunk
    if blocks.intra not in ("blocked", "column", "parallel"):
        raise ValueError(f"{name}: intra must be 'auto', 'parallel', 'blocked' or 'column', got {blocks.intra!r}")
    if blocks.inter not in ("fused", "split"):
        raise ValueError(f"{name}: inter must be 'fused' or 'split', got {blocks.inter!r}")
    if not (is_pow2(kd) and is_pow2(vd) and is_pow2(c)) or (blocks.intra != "column" and c % sub):
        raise ValueError(f"{name}: K={kd}, V={vd} and the chunk {c} must be powers of two "
                         f"(and the chunk a multiple of {sub})")
    if blocks.intra == "parallel" and not (is_pow2(blocks.key_slice) and blocks.key_slice >= 16):
        raise ValueError(f"{name}: key_slice must be a power of two >= 16, got {blocks.key_slice}")
    if blocks.intra == "parallel" and c > PARALLEL_MAX_CHUNK:
        raise ValueError(f"{name}: intra='parallel' takes chunks of at most {PARALLEL_MAX_CHUNK} tokens, got {c} (the "
                         f"inverse of a 128-row chunk asks the H200 for 384 KB of shared memory, over its 227 KB)")
    if blocks.pairs not in ("joint", "separate", "tiles", "diagonal"):
        raise ValueError(f"{name}: pairs must be 'joint', 'separate', 'tiles' or 'diagonal', got {blocks.pairs!r}")
    if type(blocks.diagonal_num_warps) is not int or blocks.diagonal_num_warps not in (0, 1, 2, 4, 8):
        raise ValueError(f"{name}: diagonal_num_warps must be 0 (auto), 1, 2, 4 or 8, "
                         f"got {blocks.diagonal_num_warps!r}")
    if blocks.solve not in ("whole", "sliced"):
        raise ValueError(f"{name}: solve must be 'whole' or 'sliced', got {blocks.solve!r}")
    if blocks.across not in ("levels", "tiles"):
        raise ValueError(f"{name}: across must be 'auto', 'levels' or 'tiles', got {blocks.across!r}")
    ps = blocks.pairs_key_slice
    if type(ps) is not int or (ps and not (is_pow2(ps) and ps >= 16)):
        raise ValueError(f"{name}: pairs_key_slice must be 0 (auto) or a power of two >= 16, got {ps!r}")
    if blocks.across == "tiles" and (blocks.intra, blocks.pairs, blocks.solve) != ("parallel", "diagonal", "sliced"):
        raise ValueError(f"{name}: across='tiles' follows the per-token launch and holds the inverse: it needs "
                         f"intra='parallel', pairs='diagonal' and solve='sliced', got intra={blocks.intra!r}, "
                         f"pairs={blocks.pairs!r}, solve={blocks.solve!r}")
    if blocks.solve == "sliced" and blocks.pairs not in ("joint", "diagonal"):
        raise ValueError(f"{name}: solve='sliced' takes the inverse from pairs='joint' or 'diagonal', "
                         f"got pairs={blocks.pairs!r}")
    if blocks.qk_norm not in IN_LAUNCH_NORMS + ("xla",):
        raise ValueError(f"{name}: qk_norm must be 'auto' or one of {IN_LAUNCH_NORMS + ('xla',)}, "
                         f"got {blocks.qk_norm!r}")
    if blocks.qk_norm.endswith("-after") and not blocks.diagonal_band:
        raise ValueError(f"{name}: qk_norm={blocks.qk_norm!r} scales the per-token launch's band: it needs "
                         f"diagonal_band=True")
    if type(blocks.diagonal_exp2) is not bool:
        raise ValueError(f"{name}: diagonal_exp2 must be True or False, got {blocks.diagonal_exp2!r}")
    for field in ("pairs_exp2", "pairs_one_loop", "qg_in_pairs"):
        if type(getattr(blocks, field)) is not bool:
            raise ValueError(f"{name}: {field} must be True or False, got {getattr(blocks, field)!r}")
    # pairs_exp2 and pairs_one_loop (on by default) shape the tiles launch and are ignored by the others; q e^G
    # from the pairs launch changes what the W, U launch writes, so it needs that launch
    if blocks.qg_in_pairs and blocks.across != "tiles":
        raise ValueError(f"{name}: qg_in_pairs is a setting of the across='tiles' launch, got across={blocks.across!r}")
    if blocks.qg_in_pairs and blocks.hands_on_norms:
        raise ValueError(f"{name}: qg_in_pairs does not combine with qk_norm={blocks.qk_norm!r} (q and k handed on "
                         f"unnormalised, with their inverse norms)")
    if type(blocks.diagonal_band) is not bool:
        raise ValueError(f"{name}: diagonal_band must be True or False, got {blocks.diagonal_band!r}")
    if type(blocks.diagonal_heads) is not int or blocks.diagonal_heads not in (0, 1, 2, 4, 8):
        raise ValueError(f"{name}: diagonal_heads must be 0 (auto), 1, 2, 4 or 8, got {blocks.diagonal_heads!r}")
    fs = blocks.factors_slice
    if type(fs) is not int or (fs and not (is_pow2(fs) and fs >= 16)):
        raise ValueError(f"{name}: factors_slice must be 0 (key_slice) or a power of two >= 16, got {fs!r}")
    for field in ("factors_num_stages", "pairs_num_stages"):
        stages = getattr(blocks, field)
        if type(stages) is not int or stages < 0:
            raise ValueError(f"{name}: {field} must be 0 (auto) or a stage count >= 1, got {stages!r}")
    if type(blocks.factors_loop) is not bool:
        raise ValueError(f"{name}: factors_loop must be True or False, got {blocks.factors_loop!r}")
    if type(blocks.factors_num_warps) is not int or blocks.factors_num_warps not in (0, 1, 2, 4, 8):
        raise ValueError(f"{name}: factors_num_warps must be 0 (num_warps) or 1, 2, 4 or 8, "
                         f"got {blocks.factors_num_warps!r}")
    if isinstance(blocks.pairs_num_warps, bool) or blocks.pairs_num_warps not in (0, 1, 2, 4, 8):
        raise ValueError(f"{name}: pairs_num_warps must be 0 (auto) or 1, 2, 4 or 8, "
                         f"got {blocks.pairs_num_warps!r}")
    if blocks.inverse not in ("tf32x3", "tf32"):
        raise ValueError(f"{name}: inverse must be 'auto', 'tf32x3' or 'tf32', got {blocks.inverse!r}")
    if isinstance(blocks.inter_num_stages, bool) or not (isinstance(blocks.inter_num_stages, int)
                                                         and blocks.inter_num_stages >= 0):
        raise ValueError(f"{name}: inter_num_stages must be 0 (auto) or a stage count >= 1, "
                         f"got {blocks.inter_num_stages!r}")
    if blocks.layout not in ("tokens", "chunked"):
        raise ValueError(f"{name}: layout must be 'tokens' or 'chunked', got {blocks.layout!r}")
    if blocks.cumsum not in ("xla", "pallas", "diagonal"):
        raise ValueError(f"{name}: cumsum must be 'auto', 'xla', 'pallas' or 'diagonal', got {blocks.cumsum!r}")
    if blocks.cumsum == "diagonal" and (blocks.intra != "parallel" or blocks.pairs != "diagonal"):
        raise ValueError(f"{name}: cumsum='diagonal' is written by the per-token launch of intra='parallel' with "
                         f"pairs='diagonal', got intra={blocks.intra!r}, pairs={blocks.pairs!r}")
    if blocks.factors not in ("float32", "bfloat16"):
        raise ValueError(f"{name}: factors must be 'auto', 'float32' or 'bfloat16', got {blocks.factors!r}")
    if blocks.factors != "float32" and blocks.inter != "fused":
        raise ValueError(f"{name}: factors={blocks.factors!r} needs inter='fused' (the split pass takes fp32 factors)")


def to_chunks(x, chunk: int):
    """[B, T, H, ...] -> [B, H, N, C, ...], the tail padded with zeros (g = beta = 0 there: a no-op)."""
    return jnp.moveaxis(to_chunk_rows(x, chunk), 3, 1)


def to_chunk_rows(x, chunk: int):
    """[B, T, H, ...] -> [B, N, C, H, ...] (the same layout, no copy when T is a multiple of the chunk;
    else the tail padded with zeros)."""
    b, t, h = x.shape[:3]
    n = -(-t // chunk)
    if n * chunk != t:
        x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(b, n, chunk, h, *x.shape[3:])


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret", "normalize_qk"))
def kda_chunk_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, blocks: ChunkBlocks = ChunkBlocks(),
                     interpret: bool | None = None, normalize_qk: bool = False):
    """Chunked KDA prefill in Pallas kernels; same contract as `kda_recurrent_reference`.

    Args:
      q, k: [B, T, H, K] L2-normalised, or with `normalize_qk` as they are, to be L2-normalised here (inside
        the per-token launch where `blocks.normalizes_qk`, else by XLA first: `gate.l2_normalize`).
        v: [B, T, H, V]. g: [B, T, H, K] log decay (<= 0).
      beta: [B, T, H] in (0, 1). scale: q multiplier (default K^-1/2).
      initial_state: [B, H, K, V] or None (zeros).
      blocks: chunk and launch settings (K, V and the chunk powers of two). interpret: default
        off the GPU.
    Returns:
      o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32.
    """
    validate_inputs(q, k, v, g, beta, initial_state)
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    c = blocks.chunk
    blocks = blocks.resolve(jnp.dtype(v.dtype).name)
    check_blocks("kda_chunk_pallas", kd, vd, blocks)
    scale = kd ** -0.5 if scale is None else scale
    interpret = default_interpret() if interpret is None else interpret
    tokens = blocks.reads_tokens
    inside = normalize_qk and blocks.normalizes_qk
    if normalize_qk and not inside:
        q, k = l2_normalize(q), l2_normalize(k)
    split = to_chunk_rows if tokens else to_chunks
    parts = [split(x, c) for x in (q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32))]
    s0 = jnp.zeros((b, h, kd, vd), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    factors = chunk_intra(*parts, scale=scale, blocks=blocks, interpret=interpret, tokens=tokens, normalize=inside)
    o, s = chunk_inter(*factors, s0, out_dtype=v.dtype, blocks=blocks, interpret=interpret, tokens=tokens)
    n = -(-t // c)
    if tokens:
        return o.reshape(b, n * c, h, vd)[:, :t], s
    return jnp.moveaxis(o.reshape(b, h, n * c, vd), 1, 2)[:, :t], s
