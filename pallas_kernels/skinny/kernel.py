"""Fused few-row projections in Pallas (Triton lowering): several weights, possibly reading
different inputs, in one launch (`plan.py` says which program does what).

Each program streams one column block of one weight over its slice of the reduction axis
(masked 16-row tiles of the input; M <= 16) and writes that block of its group's output, or an fp32
partial sum when the group's reduction axis is split. Every program reads weight bytes nobody
else reads, so the launch moves each weight exactly once.

Twin: `reference.fused_projections_reference` (one XLA dot per weight).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret
from pallas_kernels.skinny.plan import Segment, SkinnyBlocks, plan

ROWS = 16  # the smallest tile the matrix units take; calls have at most this many rows


def _kernel(*refs, segments: tuple[Segment, ...], n_groups: int, m: int):
    """refs: the group inputs, the weights (flat, in segment order), then the group outputs."""
    x_refs = refs[:n_groups]
    w_refs = refs[n_groups:n_groups + len(segments)]
    out_refs = refs[n_groups + len(segments):]
    pid = pl.program_id(0)
    row_mask = jnp.arange(ROWS) < m

    for seg in segments:
        @pl.when((pid >= seg.first) & (pid < seg.first + seg.programs))
        def _(seg=seg):
            x_ref, w_ref, out_ref = x_refs[seg.group], w_refs[seg.weight], out_refs[seg.group]
            local = pid - seg.first
            block, part = local // seg.splits, local % seg.splits
            k_len = seg.k_dim // seg.splits
            k_first = part * k_len
            cols = pl.ds(pl.multiple_of(block * seg.bn, seg.bn), seg.bn)
            in_mask = jnp.broadcast_to(row_mask[:, None], (ROWS, seg.bk))

            def step(i, acc):
                k0 = pl.multiple_of(k_first + i * seg.bk, seg.bk)
                a = plt.load(x_ref.at[pl.ds(0, ROWS), pl.ds(k0, seg.bk)], mask=in_mask, other=0.0)
                return acc + jnp.dot(a, w_ref[pl.ds(k0, seg.bk), cols], preferred_element_type=jnp.float32)

            acc = jax.lax.fori_loop(0, k_len // seg.bk, step, jnp.zeros((ROWS, seg.bn), jnp.float32))
            out_mask = jnp.broadcast_to(row_mask[:, None], (ROWS, seg.bn))
            out_cols = pl.ds(pl.multiple_of(seg.out_col + block * seg.bn, seg.bn), seg.bn)
            if seg.splits == 1:
                plt.store(out_ref.at[pl.ds(0, ROWS), out_cols], acc.astype(out_ref.dtype), mask=out_mask)
            else:
                plt.store(out_ref.at[part, pl.ds(0, ROWS), out_cols], acc, mask=out_mask)


@functools.partial(jax.jit, static_argnames=("counts", "out_dtype", "blocks", "partial_groups", "interpret"))
def fused_projections_pallas(xs, weights, *, counts: tuple[int, ...], out_dtype=None,
                             blocks: SkinnyBlocks = SkinnyBlocks(), partial_groups: tuple[int, ...] = (),
                             interpret: bool | None = None):
    # out_dtype: one dtype for every group, or a tuple with one per group.
    """out_g = x_g @ concat(weights of group g, axis=1), all groups in one launch.

    Args:
      xs: per group an input [M, K_g] (the same M <= 16 for all). weights: flat list, counts[g] of
        them [K_g, N] for group g in turn; every side a multiple of 16.
      out_dtype: result dtype, or a tuple of one per group (default each input's); accumulation is
        always fp32.
      partial_groups: groups returned as their fp32 partial sums [S, M, sum N] over the S slices of
        the reduction axis (S = 1 when unsplit), for a consumer kernel that adds them itself.
    Returns:
      a tuple of [M, sum N] per group ([S, M, sum N] for partial_groups).
    """
    m = xs[0].shape[0]
    if m > ROWS or any(x.shape[0] != m for x in xs):
        raise ValueError(f"fused projections: every input needs the same row count <= {ROWS}; got "
                         f"{[x.shape for x in xs]}")
    dtypes = tuple(out_dtype) if isinstance(out_dtype, tuple) else (out_dtype,) * len(xs)
    dtypes = tuple(jnp.dtype(jnp.float32 if g in partial_groups else (d or x.dtype))
                   for g, (d, x) in enumerate(zip(dtypes, xs)))
    groups, at = [], 0
    for g, (x, c) in enumerate(zip(xs, counts)):
        ws = weights[at:at + c]
        at += c
        if any(w.ndim != 2 or w.shape[0] != x.shape[1] for w in ws):
            raise ValueError(f"fused projections: group {g} input {x.shape} does not match weights "
                             f"{[w.shape for w in ws]}")
        groups.append((x.shape[1], tuple(w.shape[1] for w in ws)))
    segments = plan(tuple(groups), blocks)
    splits = {s.group: s.splits for s in segments}
    out_shape = tuple(
        jax.ShapeDtypeStruct((m, sum(widths)), dtypes[g]) if splits[g] == 1
        else jax.ShapeDtypeStruct((splits[g], m, sum(widths)), jnp.float32)
        for g, (_, widths) in enumerate(groups))
    outs = pl.pallas_call(
        functools.partial(_kernel, segments=segments, n_groups=len(xs), m=m),
        grid=(segments[-1].first + segments[-1].programs,),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=default_interpret() if interpret is None else interpret,
        name="fused_projections",
    )(*xs, *weights)
    if partial_groups:
        return tuple((o if splits[g] > 1 else o[None]) if g in partial_groups
                     else o if splits[g] == 1 else jnp.sum(o, axis=0).astype(dtypes[g]) for g, o in enumerate(outs))
    return tuple(o if splits[g] == 1 else jnp.sum(o, axis=0).astype(dtypes[g]) for g, o in enumerate(outs))
