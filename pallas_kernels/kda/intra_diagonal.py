"""The diagonal 16 x 16 blocks of a KDA chunk's A_kk and A_qk, one program per token
(`ChunkBlocks(pairs="diagonal")`); the blocks below the diagonal come from the next launch, by 16 x 16 tiles
(`intra_solve_tiles.py`) or by `joint_pairs_kernel`'s levels across sub-blocks (`inside=False`).

Row r of a diagonal block pairs token r with the tokens j = f .. r of its 16-row sub-block (f its first row):

    A_kk[r, j] = sum_d k_r k_j e^(G_r - G_j),    A_qk[r, j] = sum_d scale q_r k_j e^(G_r - G_j).

The program walks j down from r, carrying G_r - G_j as a running sum of the log decays g_{j+1} .. g_r: every
exponent is <= 0 for any gate, and no cumulative sum is read. The work is elementwise on [K] rows (about
8.5 steps a token on average), so many small programs run side by side where the joint kernel's bit levels
inside a sub-block were four masked [C, C] products per key slice in one program of 255 registers.

A_kk's diagonal entry (j = r) is written too (as |k_r|^2); the solve reads only j < r of A_kk.

With `normalize`, q and k arrive as they leave the short conv and the launch L2-normalises them (`gate.l2_inverse_norm`:
each k_j of the walk again, one more sum a step) and writes its own token's q / |q| and k / |k| (fp32, or bf16) for
the launches after it, in place of XLA's norm: one launch and one read of q and k fewer. Or it writes only
1 / |q| and 1 / |k| (a float a row, "scales" forms), and the later launches read q and k as they came and scale
their rows: 1 KB a token and head less written here at fp32, and each later read of q and k at their own width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda.gate import l2_inverse_norm
from pallas_kernels.kda.intra_parallel import SUB

LOG2_E = 1.4426950408889634

# `ChunkBlocks.qk_norm`'s forms that normalise q and k inside this launch
IN_LAUNCH_NORMS = ("diagonal", "diagonal-bf16", "diagonal-after", "scales", "scales-after")


def diagonal_pairs_kernel(q_ref, k_ref, g_ref, akk_ref, aqk_ref, *out_refs, scale: float, chunk: int, band: bool,
                          cumsum: bool, normalize: bool, scale_after: bool = False, scales: bool = False,
                          exp2: bool = False):
    """Program (row, head block, token t) over `heads` heads: q [heads, K] (token t), k and g
    [SUB, heads, K] (t's sub-block, g the log decay) -> row t of each head's A_kk and A_qk, fp32: with `band`
    [heads, SUB], the SUB entries of t's diagonal block (j <= t, zeros after t), else [heads, C] with zeros
    outside that block. out_refs: with `cumsum` the decay summed over t's sub-block up to t, [heads, K] (the
    running sum's last value: `intra_parallel.local_cumsum`); then with `normalize` (q and k taken as they are
    and L2-normalised here) t's q and k normalised, [heads, K] each (in those refs' dtype), or with `scales`
    their inverse norms 1 / |q_t| and 1 / |k_t|, [heads] each. `scale_after` (with `normalize` and `band`): the
    walk takes the sub-block's k rows as they are and the band is scaled by their 1 / |k_j| at the end, all SUB
    of them from one load of the block, instead of a norm a step. `exp2`: the walk carries its decay in base-2
    units (each g_j times log2 e) and takes 2^x, one hardware instruction, where e^x is a longer sequence (the
    cumsum written back in natural units)."""
    f32 = jnp.float32
    walk_unit = (lambda x: x * l2_inverse_norm(x)) if normalize and not scale_after else (lambda x: x)
    t = pl.program_id(2)
    r = t % SUB                          # t's row inside its sub-block
    first = 0 if band else t % chunk - r   # the sub-block's first column in the output row
    q = q_ref[...].astype(f32)
    k_r = k_ref[r].astype(f32)
    if normalize:
        inverse_q, inverse_k = l2_inverse_norm(q, keepdims=False), l2_inverse_norm(k_r, keepdims=False)  # [heads]
        q, k_r = q * inverse_q[:, None], k_r * inverse_k[:, None]
        for ref, x in zip(out_refs[-2:], (inverse_q, inverse_k) if scales else (q, k_r)):
            ref[...] = x.reshape(ref.shape).astype(ref.dtype)
    q = q * scale
    cols = jnp.arange(SUB if band else chunk, dtype=jnp.int32)[None, :]

    base = LOG2_E if exp2 else 1.0       # the units of the carried decay

    def step(i, carry):
        akk, aqk, decay = carry          # decay: G_t - G_j for j = r - i, [heads, K], <= 0
        j = r - i
        kd = walk_unit(k_ref[j].astype(f32)) * (jnp.exp2(decay) if exp2 else jnp.exp(decay))
        at = cols == first + j
        return (jnp.where(at, jnp.sum(k_r * kd, axis=1, keepdims=True), akk),
                jnp.where(at, jnp.sum(q * kd, axis=1, keepdims=True), aqk),
                decay + g_ref[j].astype(f32) * base)

    zeros = jnp.zeros((q.shape[0], cols.shape[1]), f32)
    akk, aqk, local = jax.lax.fori_loop(0, r + 1, step, (zeros, zeros, jnp.zeros_like(q)))
    if scale_after:    # column j of the band times 1 / |k_j| (rows past t are zeros either way)
        block = k_ref[...].astype(f32)                                            # [SUB, heads, K]
        inverse = l2_inverse_norm(block, axis=2, keepdims=False).T                # [heads, SUB]
        akk, aqk = akk * inverse, aqk * inverse
    akk_ref[...] = akk
    aqk_ref[...] = aqk
    if cumsum:
        out_refs[0][...] = local * (1.0 / base) if exp2 else local


def diagonal_pairs(qc, kc, gc, *, scale: float, tokens: bool, heads: int, num_warps: int, interpret: bool,
                   cumsum: bool = False, band: bool = False, normalize: str | None = None, exp2: bool = False):
    """The diagonal blocks of every chunk: q, k [B, H, N, C, K] (with `tokens`: [B, N, C, H, K]), g the
    log decay in the same layout, fp32 -> [A_kk, A_qk] fp32, [B, H, N, C, C] zero outside the diagonal
    16 x 16 blocks, or with `band` only those blocks, [B, H, N, C, SUB] (row r's entry j of its sub-block at
    column j % SUB: `intra_parallel.band_blocks` expands it); then with `cumsum` the local cumulative decay
    [B, H, N, C, K] fp32 (`local_cumsum`'s contract); then with `normalize` (q and k not yet L2-normalised; one
    of `ChunkBlocks.qk_norm`'s in-launch forms, IN_LAUNCH_NORMS; the "-after" forms `band` only) q and k
    normalised, fp32 (bf16 for "diagonal-bf16") in their own layout, or for the "scales" forms 1 / |q| and
    1 / |k|, fp32 in beta's layout ([B, N, C, H] with `tokens`, else [B, H, N, C]). `heads` per program (H a
    multiple of it; the tokens layout only, else 1). exp2: the walk's exponentials as 2^x
    (`ChunkBlocks.diagonal_exp2`)."""
    if normalize is not None and normalize not in IN_LAUNCH_NORMS:
        raise ValueError(f"diagonal_pairs: normalize must be None or one of {IN_LAUNCH_NORMS}, got {normalize!r}")
    scale_after = normalize is not None and normalize.endswith("-after")
    scales = normalize is not None and normalize.startswith("scales")
    if scale_after and not band:
        raise ValueError(f"diagonal_pairs: normalize={normalize!r} scales the band: it needs band=True")
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
    widths = [pair_width, pair_width] + [kd] * cumsum
    out_specs, out_shapes = [out(w) for w in widths], [shape(w) for w in widths]
    if scales:       # 1 / |q| and 1 / |k|, a float a row: [B, N, C, H] (tokens), else [B, H, N, C, 1]
        if tokens:
            norm = pl.BlockSpec((None, None, None, heads), lambda i, j, t: (i, t // c, t % c, j))
            norm_shape = (b, n, c, h)
        else:
            norm = pl.BlockSpec((None, None, None, None, 1), lambda i, j, t: (i, j, t // c, t % c, 0))
            norm_shape = (b, h, n, c, 1)
        out_specs += [norm, norm]
        out_shapes += [jax.ShapeDtypeStruct(norm_shape, jnp.float32)] * 2
    elif normalize:    # q and k in the layout they came in
        out_specs += [row, row]
        dtype = jnp.bfloat16 if normalize == "diagonal-bf16" else jnp.float32
        out_shapes += [jax.ShapeDtypeStruct(ins[0].shape, dtype)] * 2
    outs = list(pl.pallas_call(
        lambda *refs: diagonal_pairs_kernel(*refs, scale=scale, chunk=c, band=band, cumsum=cumsum,
                                            normalize=normalize is not None, scale_after=scale_after, scales=scales,
                                            exp2=exp2),
        grid=(b, h // heads, n * c), in_specs=[row, block, block], out_specs=out_specs, out_shape=out_shapes,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="kda_chunk_diagonal")(*ins))
    if normalize and not tokens:
        outs[-2:] = [x[..., 0] if scales else x[:, :, :, :, 0] for x in outs[-2:]]
    return outs
