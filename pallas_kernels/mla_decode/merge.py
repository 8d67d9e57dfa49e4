"""The merge of a split decode kernel's outputs in one Pallas launch (Triton lowering).

A split kernel leaves, per split s of the sequence, its normalised output o_s and base-2 log-sum-exp
lse_s for every query row; the whole-sequence output is sum_s 2^(lse_s - top) o_s / sum_s
2^(lse_s - top) with top = max_s lse_s. XLA runs this as four kernels (the reductions over the splits,
the exponentials, the weighted sum and division; 8.2 us at 1 x 128K over the real rows, `hopper.combine_splits`);
here one program per (batch row, block_r query rows, block_c columns) first takes the top log-sum-exp of
its rows over every split, then streams the outputs and their log-sum-exps in chunks of splits.

At one batch row the programs are few and each walks every split, so what counts is how many programs
there are and how many steps each takes. H200, device time (RESULTS.md, MLA merge sweep 2,
`benchmarks/mla_merge.py`), 1 x 128K at H = 32 (128 splits, 32 rows): 16 rows x 32 columns per program
in chunks of 8 splits (32 programs, 16 steps) 10.3 us; 4 rows x 32 columns and every split in
one step at 8 warps (128 programs), 2.9 us; XLA's four kernels 8.2 us. At 64 x 4K (2 splits) that setting
takes 11.1 us (16,384 programs of almost no work) and 8 rows x 64 columns in chunks of 16 at 4 warps the least,
4.3 us, against XLA's 3.5. `merge_settings` picks between the two measured bests by the split count.

Twin: `hopper.combine_splits` (the XLA form).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret, largest_block, next_pow2


def _kernel(o_ref, lse_ref, out_ref, *, splits: int, s_pad: int, chunk: int, rows: int, br: int, bc: int):
    b, rb, cb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = rb * br + jnp.arange(br)
    live = row < rows
    cols = pl.ds(pl.multiple_of(cb * bc, bc), bc)
    every = jnp.arange(s_pad) < splits
    lse = plt.load(lse_ref.at[b, pl.ds(0, s_pad), pl.ds(rb * br, br)], mask=every[:, None] & live[None, :],
                   other=-jnp.inf)                                                 # [s_pad, br]
    top = jnp.max(lse, axis=0)                                                     # [br]
    top = jnp.where(live, top, 0.0)

    def step(c, carry):
        num, den = carry
        first = c * chunk
        ok = (first + jnp.arange(chunk)) < splits
        mask2 = ok[:, None] & live[None, :]
        lse_c = plt.load(lse_ref.at[b, pl.ds(first, chunk), pl.ds(rb * br, br)], mask=mask2, other=-jnp.inf)
        w = jnp.exp2(lse_c - top[None, :])                                         # [chunk, br]; 0 past the end
        o = plt.load(o_ref.at[b, pl.ds(first, chunk), pl.ds(rb * br, br), cols],
                     mask=jnp.broadcast_to(mask2[:, :, None], (chunk, br, bc)), other=0.0).astype(jnp.float32)
        return num + jnp.sum(w[:, :, None] * o, axis=0), den + jnp.sum(w, axis=0)

    init = (jnp.zeros((br, bc), jnp.float32), jnp.zeros((br,), jnp.float32))
    num, den = lax.fori_loop(0, s_pad // chunk, step, init)
    plt.store(out_ref.at[b, pl.ds(rb * br, br), cols], num / jnp.where(live, den, 1.0)[:, None],
              mask=live[:, None])


MANY_SPLITS = 64   # from this many splits on, `merge_settings` takes the setting measured best at 128 splits


def merge_settings(splits: int) -> dict[str, int]:
    """Default launch settings for `splits` splits: the measured best at 128 splits (4 rows x 32 columns, every
    split in one step, 8 warps: 2.9 us at 1 x 128K) from MANY_SPLITS on, else the best at 2 splits (8 rows x 64
    columns, 16 splits a step, 4 warps: 4.3 us at 64 x 4K). RESULTS.md, MLA merge sweep 2."""
    if splits >= MANY_SPLITS:
        return dict(block_r=4, block_c=32, chunk=128, num_warps=8)
    return dict(block_r=8, block_c=64, chunk=16, num_warps=4)


def _power_of_two(name: str, value, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
        raise ValueError(f"merge splits: {name} must be a power of two >= {least}, got {value!r}")


@functools.partial(jax.jit, static_argnames=("rows", "block_r", "block_c", "chunk", "num_warps", "interpret"))
def merge_splits_pallas(o, lse, *, rows: int | None = None, block_r: int | None = None, block_c: int | None = None,
                        chunk: int | None = None, num_warps: int | None = None, interpret: bool | None = None):
    """Merge per-split outputs, `hopper.combine_splits`'s contract for the first `rows` query rows.

    Args:
      o: [B, S, R_q, C] each split's normalised output (any float dtype). lse: [B, S, R_q] fp32 their
        base-2 log-sum-exps (a split that saw nothing: -huge, weighing nothing next to any split that
        saw a slot). rows: the query rows to merge (default all R_q); rows past them are not read.
      block_r: query rows per program (a power of two); block_c: output columns per program (a power of
        two >= 16 dividing C); chunk: splits per step; num_warps: per program. None: `merge_settings(S)`.
    Returns:
      [B, rows, C] fp32.
    """
    b, splits, r_q, c = o.shape
    rows = r_q if rows is None else rows
    if lse.shape != (b, splits, r_q) or not 0 < rows <= r_q:
        raise ValueError(f"merge splits: outputs {o.shape} and log-sum-exps {lse.shape} do not match "
                         f"(rows {rows})")
    given = dict(block_r=block_r, block_c=block_c, chunk=chunk, num_warps=num_warps)
    settings = {k: v if v is not None else merge_settings(splits)[k] for k, v in given.items()}
    for name, least in (("block_r", 1), ("block_c", 16), ("chunk", 1), ("num_warps", 1)):
        _power_of_two(name, settings[name], least)
    block_r, block_c, chunk, num_warps = (settings[k] for k in ("block_r", "block_c", "chunk", "num_warps"))
    bc = largest_block(c, block_c)
    if bc is None:
        raise ValueError(f"merge splits: {c} output columns is not a multiple of 16")
    chunk = min(next_pow2(chunk), next_pow2(splits))
    s_pad = -(-next_pow2(splits) // chunk) * chunk
    return pl.pallas_call(
        functools.partial(_kernel, splits=splits, s_pad=s_pad, chunk=chunk, rows=rows, br=block_r, bc=bc),
        grid=(b, -(-rows // block_r), c // bc),
        out_shape=jax.ShapeDtypeStruct((b, rows, c), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=default_interpret() if interpret is None else interpret,
        name="mla_merge_splits",
    )(o, lse.astype(jnp.float32))
