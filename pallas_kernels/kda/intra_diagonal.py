"""The diagonal 16 x 16 blocks of a KDA chunk's A_kk and A_qk, one program per token
(`ChunkBlocks(pairs="diagonal")`); the blocks below the diagonal stay with `joint_pairs_kernel`'s levels
across sub-blocks (`inside=False`).

Row r of a diagonal block pairs token r with the tokens j = f .. r of its 16-row sub-block (f its first row):

    A_kk[r, j] = sum_d k_r k_j e^(G_r - G_j),    A_qk[r, j] = sum_d scale q_r k_j e^(G_r - G_j).

The program walks j down from r, carrying G_r - G_j as a running sum of the log decays g_{j+1} .. g_r: every
exponent is <= 0 for any gate, and no cumulative sum is read. The work is elementwise on [K] rows (about
8.5 steps a token on average), so many small programs run side by side where the joint kernel's bit levels
inside a sub-block were four masked [C, C] products per key slice in one program of 255 registers.

A_kk's diagonal entry (j = r) is written too (as |k_r|^2); the solve reads only j < r of A_kk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda.intra_parallel import SUB


def diagonal_pairs_kernel(q_ref, k_ref, g_ref, akk_ref, aqk_ref, *l_ref, scale: float, chunk: int, band: bool):
    """Program (row, head block, token t) over `heads` heads: q [heads, K] (token t), k and g
    [SUB, heads, K] (t's sub-block, g the log decay) -> row t of each head's A_kk and A_qk, fp32: with `band`
    [heads, SUB], the SUB entries of t's diagonal block (j <= t, zeros after t), else [heads, C] with zeros
    outside that block; with l_ref, also the decay summed over t's sub-block up to t, [heads, K] (the running
    sum's last value: `intra_parallel.local_cumsum`)."""
    f32 = jnp.float32
    t = pl.program_id(2)
    r = t % SUB                          # t's row inside its sub-block
    first = 0 if band else t % chunk - r   # the sub-block's first column in the output row
    q = q_ref[...].astype(f32) * scale
    k_r = k_ref[r].astype(f32)
    cols = jnp.arange(SUB if band else chunk, dtype=jnp.int32)[None, :]

    def step(i, carry):
        akk, aqk, decay = carry          # decay: G_t - G_j for j = r - i, [heads, K], <= 0
        j = r - i
        kd = k_ref[j].astype(f32) * jnp.exp(decay)
        at = cols == first + j
        return (jnp.where(at, jnp.sum(k_r * kd, axis=1, keepdims=True), akk),
                jnp.where(at, jnp.sum(q * kd, axis=1, keepdims=True), aqk),
                decay + g_ref[j].astype(f32))

    zeros = jnp.zeros((q.shape[0], cols.shape[1]), f32)
    akk, aqk, local = jax.lax.fori_loop(0, r + 1, step, (zeros, zeros, jnp.zeros_like(q)))
    akk_ref[...] = akk
    aqk_ref[...] = aqk
    if l_ref:
        l_ref[0][...] = local


def diagonal_pairs(qc, kc, gc, *, scale: float, tokens: bool, heads: int, num_warps: int, interpret: bool,
                   cumsum: bool = False, band: bool = False):
    """The diagonal blocks of every chunk: q, k [B, H, N, C, K] (with `tokens`: [B, N, C, H, K]), g the
    log decay in the same layout, fp32 -> (A_kk, A_qk) fp32, [B, H, N, C, C] zero outside the diagonal
    16 x 16 blocks, or with `band` only those blocks, [B, H, N, C, SUB] (row r's entry j of its sub-block at
    column j % SUB: `intra_parallel.band_blocks` expands it); with `cumsum` also the local cumulative decay [B, H, N, C, K]
    fp32 (`local_cumsum`'s contract). `heads` per program (H a multiple of it; the tokens layout only, else 1)."""
    if tokens:
        b, n, c, h, kd = qc.shape
        row = pl.BlockSpec((None, None, None, heads, kd), lambda i, j, t: (i, t // c, t % c, j, 0))
        block = pl.BlockSpec((None, None, SUB, heads, kd), lambda i, j, t: (i, t // c, t % c // SUB, j, 0))
        ins = (qc, kc, gc)
    else:
        b, h, n, c, kd = qc.shape
        if heads != 1:
            raise ValueError(f"diagonal_pairs: {heads} heads per program needs the tokens layout")
        # a head axis of one, so the kernel sees [1, K] rows and [SUB, 1, K] blocks as in the tokens layout
        ins = tuple(x[:, :, :, :, None] for x in (qc, kc, gc))
        row = pl.BlockSpec((None, None, None, None, 1, kd), lambda i, j, t: (i, j, t // c, t % c, 0, 0))
        block = pl.BlockSpec((None, None, None, SUB, 1, kd), lambda i, j, t: (i, j, t // c, t % c // SUB, 0, 0))
    if h % heads:
        raise ValueError(f"diagonal_pairs: H={h} is not a multiple of {heads} heads per program")
    out = lambda width: pl.BlockSpec((None, heads, None, None, width), lambda i, j, t: (i, j, t // c, t % c, 0))
    shape = lambda width: jax.ShapeDtypeStruct((b, h, n, c, width), jnp.float32)
    pair_width = SUB if band else c
    widths = (pair_width, pair_width, kd) if cumsum else (pair_width, pair_width)
    return pl.pallas_call(
        lambda *refs: diagonal_pairs_kernel(*refs, scale=scale, chunk=c, band=band),
        grid=(b, h // heads, n * c), in_specs=[row, block, block], out_specs=[out(w) for w in widths],
        out_shape=[shape(w) for w in widths],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="kda_chunk_diagonal")(*ins)

