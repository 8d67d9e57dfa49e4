"""Row-tiled grouped matmul in Pallas (Triton lowering): one program per (row tile, column block).

Rows arrive sorted by group (expert). `schedule.tile_schedule` cuts each non-empty group into
tiles of up to block_m rows; a program loads its tile's group id and row range, streams that
group's weight columns [K, block_n] once over the reduction axis, and writes only its own rows
(masked), so empty groups cost nothing and each touched expert's weights are read once per row
tile. Two epilogues:

* plain: out = lhs @ w[g], optionally times a per-row fp32 scale (the routing weight);
* glu:   out = act(lhs @ w_gate[g], lhs @ w_up[g]), both products from one read of the activations.

Weights may also be MXFP4, kept packed (`mxfp4.Mxfp4Weight`: a quarter of the bytes), decoded in
registers one 32-input scale group at a time: to exact bf16 (the table), or compiled to raw values
(x 2^-126) by inline PTX on whole registers (`mxfp4_asm.py`) with each group's factor applied to its sum.

Twin: `reference.grouped_matmul_reference` / `reference.grouped_glu_reference` (lax.ragged_dot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import SM_COUNT, default_interpret, is_pow2, largest_block
from pallas_kernels.moe_gmm.activation import GluSpec, glu
from pallas_kernels.moe_gmm.mxfp4 import (GROUP, RAW_SCALE_OFFSET, Mxfp4Weight, decode_e2m1, decode_e2m1_raw,
                                          raw_scale_factor, scale_factor, split_even_odd)
from pallas_kernels.moe_gmm.mxfp4 import validate as validate_mxfp4
from pallas_kernels.moe_gmm.mxfp4_asm import decode_e2m1_asm, decode_e2m1_bf16_asm, raw_scale_factor_asm
from pallas_kernels.moe_gmm.schedule import tile_schedule
from pallas_kernels.moe_gmm.tuning import E2M1_DECODES, TileBlocks


def _kernel(*refs, bm, bn, bk, k_dim, spec, scaled, repeat, quantized, gemv=False, e2m1="bits", split_k=1,
            extra_from=None):
    """refs: the schedule (sorted rows: one [3, tiles] ref; pairs: group [M] and valid [M]), lhs,
    w (plain) or w_gate, w_up (glu); then, when `extra_from` is set, a second set of the same
    weights holding groups extra_from, extra_from + 1, ... (pairs only: e.g. the shared experts
    riding in the routed experts' launch); then the row scale when `scaled`; then out.

    Pairs (`repeat` > 0): program `tile` computes output row `tile` from lhs row tile // repeat, and
    writes zeros when the pair is not valid (no masking pass after the kernel).

    `quantized` (MXFP4, `mxfp4.py`): lhs arrives as its even and odd inputs [M, K/2] and each weight
    as packed [G, K/2, N] and scale [G, K/32, N]; each step decodes bk inputs (bk/2 packed rows, bk/32
    scale groups) in registers and multiplies both nibbles' halves: exact bf16 weights (the table) or,
    with e2m1 "asm" and bf16 activations, raw bf16 values per scale group (`_tile`, `step_mxfp4_asm`).

    `gemv` (pairs on MXFP4 only, `_gemv_row`): the program's one row is multiplied on the CUDA cores
    into a [bk/32, 16, bn] fp32 accumulator per weight (no tensor-core tile, no layout change of the
    decoded weights), summed once after the loop; `e2m1` picks its decode. With `split_k` > 1 program
    (tile, col, part) covers part `part` of the reduction and out is fp32 [weights, split_k, M, N]
    partial sums (zeros for pairs that are not valid), the epilogue left to the caller."""
    pairs = repeat > 0
    sched = refs[:2] if pairs else refs[:1]
    n_lhs = 2 if quantized else 1
    lhs_refs, refs = refs[len(sched):len(sched) + n_lhs], refs[len(sched) + n_lhs:]
    n_weights = (1 if spec is None else 2) * n_lhs
    w_refs, rest = refs[:n_weights], refs[n_weights:]
    if extra_from is not None:
        extra_refs, rest = rest[:n_weights], rest[n_weights:]
    scale_ref = rest[0] if scaled else None
    out_ref = rest[-1]
    tile, col = pl.program_id(0), pl.program_id(1)
    if pairs:
        group, first, last, src = sched[0][tile], tile, tile + sched[1][tile], tile // repeat
    else:
        group, first, last = sched[0][0, tile], sched[0][1, tile], sched[0][2, tile]
        src = first
    cols = pl.ds(col * bn, bn)

    part = pl.program_id(2) if split_k > 1 else None
    if pairs:
        @pl.when(first >= last)
        def _():
            if part is None:
                out_ref[pl.ds(first, 1), cols] = jnp.zeros((1, bn), out_ref.dtype)
            else:
                for w in range(out_ref.shape[0]):
                    out_ref[w, part, first, cols] = jnp.zeros((bn,), out_ref.dtype)

    if gemv:
        @pl.when(first < last)
        def _():
            _gemv_row(lhs_refs, w_refs, scale_ref, out_ref, group=group, src=src, row=first, cols=cols, bn=bn,
                      bk=bk, k_dim=k_dim, spec=spec, e2m1=e2m1, split_k=split_k, part=part)
        return

    if extra_from is None:
        pl.when(first < last)(lambda: _tile(lhs_refs, w_refs, scale_ref, out_ref, group=group, first=first, last=last,
                                            src=src, cols=cols, bm=bm, bn=bn, bk=bk, k_dim=k_dim, spec=spec,
                                            scaled=scaled, quantized=quantized, e2m1=e2m1))
        return
    for weights, lo, at in ((w_refs, 0, (first < last) & (group < extra_from)),
                            (extra_refs, extra_from, (first < last) & (group >= extra_from))):
        pl.when(at)(functools.partial(_tile, lhs_refs, weights, scale_ref, out_ref, group=group - lo, first=first,
                                      last=last, src=src, cols=cols, bm=bm, bn=bn, bk=bk, k_dim=k_dim, spec=spec,
                                      scaled=scaled, quantized=quantized))


def _tile(lhs_refs, w_refs, scale_ref, out_ref, *, group, first, last, src, cols, bm, bn, bk, k_dim, spec, scaled,
          quantized, e2m1="table"):
    """One row tile (rows [first, last), lhs rows from `src`) times columns `cols` of group `group`
    of the weights in w_refs, with the epilogue; see `_kernel`. MXFP4 weights decode with the table
    (`mxfp4.decode_e2m1`, exact weights in the activations' dtype) unless `e2m1` is "asm" and the
    activations are bf16 (`step_mxfp4_asm`, which multiplies in bf16); "bits" means the table here."""
    n_lhs = len(lhs_refs)
    rows = first + jnp.arange(bm)
    row_mask = rows < last

    def step(kk, accs):
        k0 = pl.multiple_of(kk * bk, bk)
        a = plt.load(lhs_refs[0].at[pl.ds(src, bm), pl.ds(k0, bk)],
                     mask=jnp.broadcast_to(row_mask[:, None], (bm, bk)), other=0.0)
        return tuple(acc + jnp.dot(a, w[group, pl.ds(k0, bk), cols], preferred_element_type=jnp.float32)
                     for acc, w in zip(accs, w_refs))

    def step_mxfp4(kk, accs):
        half, groups = bk // 2, bk // GROUP
        r0 = pl.multiple_of(kk * half, half)
        mask = jnp.broadcast_to(row_mask[:, None], (bm, half))
        a_lo, a_hi = (plt.load(ref.at[pl.ds(src, bm), pl.ds(r0, half)], mask=mask, other=0.0) for ref in lhs_refs)
        out = []
        for acc, packed, scale in zip(accs, w_refs[0::2], w_refs[1::2]):
            codes = packed[group, pl.ds(r0, half), cols].astype(jnp.int32)             # [bk/2, bn]
            factor = scale_factor(scale[group, pl.ds(kk * groups, groups), cols])       # [bk/32, bn]
            factor = jnp.broadcast_to(factor[:, None, :], (groups, GROUP // 2, bn)).reshape(half, bn)
            w_lo = (decode_e2m1(codes) * factor).astype(a_lo.dtype)
            w_hi = (decode_e2m1(codes >> 4) * factor).astype(a_lo.dtype)
            out.append(acc + jnp.dot(a_lo, w_lo, preferred_element_type=jnp.float32)
                       + jnp.dot(a_hi, w_hi, preferred_element_type=jnp.float32))
        return tuple(out)

    def step_mxfp4_asm(kk, accs):
        """One scale group at a time: raw bf16 values (x 2^-126, `decode_e2m1_bf16_asm`) into the tensor
        cores against activations lifted by 2^RAW_SCALE_OFFSET, the group's factor on the fp32 product."""
        per, groups = GROUP // 2, bk // GROUP
        mask = jnp.broadcast_to(row_mask[:, None], (bm, per))
        out = list(accs)
        for j in range(groups):
            r0 = pl.multiple_of(kk * (bk // 2) + j * per, per)
            a_lo, a_hi = ((plt.load(ref.at[pl.ds(src, bm), pl.ds(r0, per)], mask=mask, other=0.0)
                           .astype(jnp.float32) * float(2 ** RAW_SCALE_OFFSET)).astype(jnp.bfloat16)
                          for ref in lhs_refs)
            for i, (packed, scale) in enumerate(zip(w_refs[0::2], w_refs[1::2])):
                w_lo, w_hi = decode_e2m1_bf16_asm(packed[group, pl.ds(r0, per), cols])             # [16, bn]
                factor = raw_scale_factor_asm(scale[group, kk * groups + j, cols])                  # [bn]
                prod = (jnp.dot(a_lo, w_lo, preferred_element_type=jnp.float32)
                        + jnp.dot(a_hi, w_hi, preferred_element_type=jnp.float32))
                out[i] = out[i] + prod * factor[None, :]
        return tuple(out)

    zeros = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in w_refs[::n_lhs])
    if quantized and e2m1 == "asm" and lhs_refs[0].dtype == jnp.bfloat16:   # other activations: exact weights
        accs = jax.lax.fori_loop(0, k_dim // bk, step_mxfp4_asm, zeros)
    elif quantized:
        accs = jax.lax.fori_loop(0, k_dim // bk, step_mxfp4, zeros)
    else:
        accs = jax.lax.fori_loop(0, k_dim // bk, step, zeros)
    if spec is not None:
        out = glu(accs[0], accs[1], spec)
    elif scaled:
        out = accs[0] * plt.load(scale_ref.at[pl.ds(first, bm)], mask=row_mask, other=0.0)[:, None]
    else:
        out = accs[0]
    plt.store(out_ref.at[pl.ds(first, bm), cols], out.astype(out_ref.dtype),
              mask=jnp.broadcast_to(row_mask[:, None], (bm, bn)))


def _gemv_row(lhs_refs, w_refs, scale_ref, out_ref, *, group, src, row, cols, bn, bk, k_dim, spec, e2m1, split_k=1,
              part=None):
    """One output row of a pair on MXFP4 weights (see `_kernel`, `gemv`). The refs arrive with each
    scale group's 16 packed rows as their own axis (lhs halves [M, K/32, 16], packed [G, K/32, 16, N]),
    so a step's [bk/32, 16, bn] codes take their scales [bk/32, 1, bn] by broadcasting alone.

    With `split_k` > 1 the program runs steps [part, part + 1) x steps / split_k and writes its raw
    sums to out_ref[:, part, row, cols]. (Loading a step ahead in the loop carry was measured: no gain,
    `benchmarks/RESULTS.md`, MXFP4 runs 6-7.)"""
    groups, per = bk // GROUP, GROUP // 2
    steps = k_dim // bk
    if split_k > 1:
        begin, end = part * (steps // split_k), (part + 1) * (steps // split_k)
    else:
        begin, end = 0, steps
    # The raw decodes (values x 2^-126) take 2^RAW_SCALE_OFFSET on the activations, so that each
    # product, and the scale group's sum before its factor, is a normal fp32.
    lift = float(2 ** RAW_SCALE_OFFSET) if e2m1 in ("bits", "asm") else 1.0

    def step(kk, accs):
        g0 = pl.multiple_of(kk * groups, groups)
        a_lo, a_hi = (ref[src, pl.ds(g0, groups), :].astype(jnp.float32)[:, :, None] * lift for ref in lhs_refs)
        out = []
        for acc, packed, scale in zip(accs, w_refs[0::2], w_refs[1::2]):
            codes = packed[group, pl.ds(g0, groups), :, cols]                               # [bk/32, 16, bn] u8
            s = scale[group, pl.ds(g0, groups), cols]                                       # [bk/32, bn]
            if e2m1 == "asm":
                factor, (w_lo, w_hi) = raw_scale_factor_asm(s), decode_e2m1_asm(codes)
            elif e2m1 == "bits":
                codes = codes.astype(jnp.int32)
                factor, w_lo, w_hi = raw_scale_factor(s), decode_e2m1_raw(codes, False), decode_e2m1_raw(codes, True)
            else:
                codes = codes.astype(jnp.int32)
                factor, w_lo, w_hi = scale_factor(s), decode_e2m1(codes), decode_e2m1(codes >> 4)
            out.append(acc + (a_lo * w_lo + a_hi * w_hi) * factor[:, None, :])   # exact: factor is a power of two
        return tuple(out)

    zeros = tuple(jnp.zeros((groups, per, bn), jnp.float32) for _ in w_refs[::2])
    sums = [jnp.sum(jnp.sum(acc, axis=0), axis=0) for acc in jax.lax.fori_loop(begin, end, step, zeros)]  # [bn]
    if split_k > 1:
        for w, v in enumerate(sums):
            out_ref[w, part, row, cols] = v
        return
    out_ref[row, cols] = _row_epilogue(sums, spec, None if scale_ref is None else scale_ref[row]).astype(out_ref.dtype)


def _row_epilogue(sums, spec, scale):
    """The pair rows' epilogue on fp32 sums (one per weight): act(gate, up), or the product times
    `scale` (the routing weight, broadcastable), or the product alone."""
    if spec is not None:
        return glu(sums[0], sums[1], spec)
    return sums[0] if scale is None else sums[0] * scale


def _interpreted(interpret: bool | None) -> bool:
    return default_interpret() if interpret is None else interpret


def _blocks_for(k_dim: int, n_dim: int, blocks: TileBlocks) -> tuple[int, int]:
    bn, bk = largest_block(n_dim, blocks.block_n), largest_block(k_dim, blocks.block_k)
    if not (is_pow2(blocks.block_n) and is_pow2(blocks.block_k)) or bn is None or bk is None:
        raise ValueError(f"grouped matmul (pallas): K={k_dim} and N={n_dim} must be multiples of 16 and the "
                         f"blocks powers of two (block_k={blocks.block_k}, block_n={blocks.block_n})")
    return bn, bk


def _split_k(setting: int, steps: int, programs: int) -> int:
    """Parts of the reduction per output block: `setting` when given (a divisor of the steps), else
    (0) the largest divisor of the steps that brings the launch to about two programs per SM."""
    if setting:
        if steps % setting:
            raise ValueError(f"grouped matmul (pallas): split_k={setting} does not divide the {steps} reduction steps")
        return setting
    want = -(-2 * SM_COUNT // max(programs, 1))
    return max(d for d in range(1, min(want, steps) + 1) if steps % d == 0)


def _call(lhs, weights, group_sizes, row_scale, *, spec, out_dtype, blocks: TileBlocks, interpret, pairs=None,
          repeat: int = 1, extra=None):
    """`pairs` = (group [M], valid [M]): one tile per output row instead of the group schedule (rows
    unsorted); output row r reads lhs row r // repeat. `extra` (pairs, unquantized): a second set of
    weights like `weights` whose groups follow theirs (ids G, G + 1, ...)."""
    k_dim = lhs.shape[1]
    n_dim = weights[0].shape[2]
    bn, bk = _blocks_for(k_dim, n_dim, blocks)
    quantized = isinstance(weights[0], Mxfp4Weight)
    bk = max(bk, GROUP) if quantized else bk    # whole scale groups per step (K is a multiple of 32)
    if quantized:
        lhs_parts = split_even_odd(lhs)
        weights = tuple(part for w in weights for part in (w.packed, w.scale))
    else:
        lhs_parts = (lhs,)
    bm = blocks.block_m
    if pairs is None:
        m = lhs.shape[0]
        sched = (tile_schedule(group_sizes, m, bm),)
        tiles = sched[0].shape[1]
    else:
        group, valid = pairs
        m = tiles = group.shape[0]
        sched = (jnp.where(valid, group, 0).astype(jnp.int32), valid.astype(jnp.int32))
    scaled = row_scale is not None
    gemv = quantized and pairs is not None and blocks.gemv
    if blocks.e2m1 not in E2M1_DECODES:
        raise ValueError(f"grouped matmul (pallas): e2m1 must be one of {E2M1_DECODES}, got {blocks.e2m1!r}")
    split_k = _split_k(blocks.split_k, k_dim // bk, tiles * (n_dim // bn)) if gemv else 1
    if gemv:    # scale groups as their own axis (free reshapes of contiguous arrays)
        lhs_parts = tuple(part.reshape(part.shape[0], k_dim // GROUP, GROUP // 2) for part in lhs_parts)
        weights = tuple(w.reshape(w.shape[0], k_dim // GROUP, GROUP // 2, n_dim) if i % 2 == 0 else w
                        for i, w in enumerate(weights))
    extra_from = None
    if extra is not None:
        if quantized or pairs is None or any(isinstance(w, Mxfp4Weight) for w in extra):
            raise ValueError("grouped matmul (pallas): extra weights are for unquantized pairs only")
        if any(w.shape[1:] != (k_dim, n_dim) or w.dtype != weights[0].dtype for w in extra):
            raise ValueError(f"grouped matmul (pallas): extra weights {[w.shape for w in extra]} do not match "
                             f"[S, {k_dim}, {n_dim}] {weights[0].dtype}")
        extra_from = weights[0].shape[0]
    kernel = functools.partial(_kernel, bm=bm, bn=bn, bk=bk, k_dim=k_dim, spec=spec, scaled=scaled,
                               repeat=0 if pairs is None else repeat, quantized=quantized, gemv=gemv, e2m1=blocks.e2m1,
                               split_k=split_k, extra_from=extra_from)
    operands = (*sched, *lhs_parts, *weights, *(extra or ())) + ((row_scale.astype(jnp.float32),) if scaled else ())
    out_shape = (jax.ShapeDtypeStruct((m, n_dim), out_dtype) if split_k == 1 else
                 jax.ShapeDtypeStruct((len(weights) // 2, split_k, m, n_dim), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(tiles, n_dim // bn) + ((split_k,) if split_k > 1 else ()),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=default_interpret() if interpret is None else interpret,
        name="grouped_glu" if spec is not None else "grouped_matmul",
    )(*operands)
    if split_k > 1:        # the epilogue of `_gemv_row` on the summed parts (pairs not valid: zeros)
        scale = jnp.where(pairs[1], row_scale.astype(jnp.float32), 0.0)[:, None] if scaled else None
        return _row_epilogue(jnp.sum(out, axis=1), spec, scale).astype(out_dtype)
    if pairs is not None:  # every row is written (zeros where not valid)
        return out
    covered = jnp.arange(m)[:, None] < jnp.sum(group_sizes)
    return jnp.where(covered, out, jnp.zeros((), out_dtype))  # rows outside every tile are never written


def _validate(lhs, weights, group_sizes):
    kinds = {isinstance(w, Mxfp4Weight) for w in weights}
    if len(kinds) > 1:
        raise ValueError("grouped matmul: gate and up weights must both be MXFP4 or both not")
    for w in weights:
        if isinstance(w, Mxfp4Weight):
            validate_mxfp4(w)
        if lhs.ndim != 2 or w.ndim != 3 or lhs.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
            raise ValueError(f"grouped matmul: expected lhs [M, K], rhs [G, K, N], group_sizes [G]; got "
                             f"{lhs.shape}, {w.shape}, {group_sizes.shape}")
    if len(weights) == 2 and weights[0].shape != weights[1].shape:
        raise ValueError(f"grouped glu: gate and up weights differ: {weights[0].shape} vs {weights[1].shape}")


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def grouped_matmul_pallas(lhs, rhs, group_sizes, row_scale=None, *, blocks: TileBlocks | None = None,
                          interpret: bool | None = None):
    """out[r] = lhs[r] @ rhs[g(r)] (times row_scale[r]) for rows sorted by group.

    Args:
      lhs: [M, K] rows sorted by group. rhs: [G, K, N] (or an `Mxfp4Weight`). group_sizes: [G] int32 (sum <= M).
      row_scale: optional [M] fp32 per-row factor; with it the output is fp32.
      blocks: tile sizes (default: chosen from the average rows per group). interpret: default
        off the GPU.
    Returns:
      [M, N] in lhs's dtype (fp32 with row_scale); rows past sum(group_sizes) are zero.
    """
    _validate(lhs, (rhs,), group_sizes)
    blocks = blocks or TileBlocks.for_rows(lhs.shape[0] / rhs.shape[0], isinstance(rhs, Mxfp4Weight),
                                           _interpreted(interpret))
    out_dtype = jnp.float32 if row_scale is not None else lhs.dtype
    return _call(lhs, (rhs,), group_sizes, row_scale, spec=None, out_dtype=out_dtype, blocks=blocks,
                 interpret=interpret)


@functools.partial(jax.jit, static_argnames=("spec", "blocks", "interpret"))
def grouped_glu_pallas(lhs, w_gate, w_up, group_sizes, *, spec: GluSpec = GluSpec(), blocks: TileBlocks | None = None,
                       interpret: bool | None = None):
    """out[r] = act(lhs[r] @ w_gate[g(r)], lhs[r] @ w_up[g(r)]) for rows sorted by group.

    Args:
      lhs: [M, K] rows sorted by group. w_gate, w_up: [G, K, F] (or both `Mxfp4Weight`). group_sizes: [G] int32.
      spec: the gated activation. blocks / interpret: as `grouped_matmul_pallas`.
    Returns:
      [M, F] in lhs's dtype; rows past sum(group_sizes) are zero.
    """
    _validate(lhs, (w_gate, w_up), group_sizes)
    blocks = blocks or TileBlocks.for_rows(lhs.shape[0] / w_gate.shape[0], isinstance(w_gate, Mxfp4Weight),
                                           _interpreted(interpret))
    return _call(lhs, (w_gate, w_up), group_sizes, None, spec=spec, out_dtype=lhs.dtype, blocks=blocks,
                 interpret=interpret)


def _validate_pairs(lhs, group, valid, repeat: int):
    if repeat < 1 or group.shape != valid.shape or group.ndim != 1 or group.shape[0] != lhs.shape[0] * repeat:
        raise ValueError(f"pair matmul: expected group and valid [M] with M = lhs rows x repeat; got lhs {lhs.shape}, "
                         f"group {group.shape}, valid {valid.shape}, repeat {repeat}")


@functools.partial(jax.jit, static_argnames=("spec", "repeat", "blocks", "interpret"))
def pair_glu_pallas(lhs, w_gate, w_up, group, valid, *, spec: GluSpec = GluSpec(), repeat: int = 1,
                    extra: tuple | None = None, blocks: TileBlocks | None = None, interpret: bool | None = None):
    """Unsorted pairs, one tile each: out[r] = act(x @ w_gate[group[r]], x @ w_up[group[r]]) with
    x = lhs[r // repeat] where valid[r], else 0. For a few rows (decode) this skips the sort and the
    schedule; a group chosen by several rows is read once per row.

    Args:
      lhs: [M / repeat, K] (each row serves `repeat` consecutive pairs: a token's expert choices).
      w_gate, w_up: [G, K, F] (or both `Mxfp4Weight`). group: [M] int32 in [0, G). valid: [M] bool.
      extra: optional (gate, up) [S, K, F] of S more groups, ids G .. G + S - 1 (bf16 weights only:
        the shared experts in the same launch as the routed ones).
    Returns:
      [M, F] in lhs's dtype.
    """
    _validate(lhs, (w_gate, w_up), jnp.zeros((w_gate.shape[0],), jnp.int32))
    _validate_pairs(lhs, group, valid, repeat)
    return _call(lhs, (w_gate, w_up), None, None, spec=spec, out_dtype=lhs.dtype,
                 blocks=blocks or TileBlocks.for_pairs(group.shape[0], w_gate.shape[1], w_gate.shape[2],
                                                       isinstance(w_gate, Mxfp4Weight), _interpreted(interpret)),
                 interpret=interpret,
                 pairs=(group, valid), repeat=repeat, extra=None if extra is None else tuple(extra))


@functools.partial(jax.jit, static_argnames=("repeat", "blocks", "interpret"))
def pair_matmul_pallas(lhs, rhs, group, valid, row_scale=None, *, repeat: int = 1, extra=None,
                       blocks: TileBlocks | None = None, interpret: bool | None = None):
    """Unsorted pairs, one tile each: out[r] = lhs[r // repeat] @ rhs[group[r]] (times row_scale[r])
    where valid[r], else 0 (row_scale is not read there). Shapes as `pair_glu_pallas` with rhs
    [G, K, N] and `extra` [S, K, N] (groups G ..); -> [M, N] (fp32 with row_scale)."""
    _validate(lhs, (rhs,), jnp.zeros((rhs.shape[0],), jnp.int32))
    _validate_pairs(lhs, group, valid, repeat)
    out_dtype = jnp.float32 if row_scale is not None else lhs.dtype
    return _call(lhs, (rhs,), None, row_scale, spec=None, out_dtype=out_dtype,
                 blocks=blocks or TileBlocks.for_pairs(group.shape[0], rhs.shape[1], rhs.shape[2],
                                                       isinstance(rhs, Mxfp4Weight), _interpreted(interpret)),
                 interpret=interpret, pairs=(group, valid), repeat=repeat, extra=None if extra is None else (extra,))
