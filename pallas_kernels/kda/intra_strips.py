"""A_kk and A_qk of a KDA chunk by 16-row strips (`ChunkBlocks(pairs="strips")`): the same outputs as
`intra_parallel.joint_pairs_kernel`, with the matrix-product work of the pairs that need it and the rest on
the CUDA cores.

A chunk's C / 16 row blocks (the sub-blocks of the local cumulative decay) each fill one [16, C] strip of
both outputs:

- left of the diagonal, the rows of block b against every earlier column j: e^(G_r - G_j) =
  e^(G_r - G_f) e^(G_f - G_j) with f the first row of block b; both exponents are <= 0 for any gate
  (G_r <= G_f <= G_j), so the strip is one product of the strip's rows, scaled by e^(G_r - G_f), against all
  C rows of k scaled by e^(G_f - G_j) (zero from row f on), over the whole key width at once;
- on the diagonal, the pairs (r, r - d) inside block b for d = 0 .. 15, one offset per loop step on the CUDA
  cores: sum_i left_r,i k_(r-d),i e^(L_r,i - L_(r-d),i), with L the decay summed inside the sub-block, so
  every exponent is a difference of two sums over at most 16 rows and is <= 0.

Per chunk and matrix this is C / 16 - 1 products of [16, K] x [K, C] (the joint kernel: log2(C) masked
[C, C] products per key slice) and C x 16 x K exponentials for the diagonal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.intra_parallel import SUB, _block_offsets, _dot_t, _pick


def strip_pairs_kernel(q_ref, k_ref, l_ref, akk_ref, aqk_ref, *, scale: float):
    """One chunk: q/k [C, K], l (the decay summed inside each 16-row sub-block) [C, K] fp32 ->
    akk [C, C] (j < r) and aqk [C, C] (j <= r, q scaled), zero above the diagonal. The strips run as a loop."""
    f32 = jnp.float32
    c, kd = k_ref.shape
    nb = c // SUB
    rows_all = jnp.arange(c, dtype=jnp.int32)
    local_rows = jnp.arange(SUB, dtype=jnp.int32)
    cols = rows_all[None, :]

    def strip(b, carry):
        f = pl.multiple_of(b * SUB, SUB)
        rs = pl.ds(f, SUB)
        rows = f + local_rows                                  # the strip's rows in the chunk
        q = q_ref[rs, :].astype(f32) * scale
        k = k_ref[rs, :].astype(f32)
        local = l_ref[rs, :]
        # G_f - G_j for j before block b: L_f + (the decay of j's block .. block b-1) - L_j; the blocks' decays
        # are their last rows of l, summed as offsets so that G's full magnitude never enters
        l_all = l_ref[...]
        refrow, offsets = _block_offsets(l_ref, pl.ds(0, kd), l_all, rows_all, nb)
        before_b = _pick(jnp.full((1,), b, jnp.int32), offsets)           # [1, K]: the decay of blocks 0 .. b-1
        y = jnp.where((rows_all < f)[:, None], jnp.exp(l_ref[f, :][None, :] + (before_b - refrow) - l_all), 0.0)
        ky = k_ref[...].astype(f32) * y
        x = jnp.exp(local - l_ref[f, :][None, :])              # e^(G_r - G_f)
        akk = _dot_t(k * x, ky)
        aqk = _dot_t(q * x, ky)

        def offset(d, accs):
            akk, aqk = accs
            j = jnp.maximum(rows - d, f)                       # rows before the block are masked below
            e = k_ref[j, :].astype(f32) * jnp.exp(local - l_ref[j, :])
            at = (cols == (rows - d)[:, None]) & (local_rows >= d)[:, None]
            aqk = jnp.where(at, jnp.sum(q * e, axis=1)[:, None], aqk)
            akk = jnp.where(at & (d > 0), jnp.sum(k * e, axis=1)[:, None], akk)
            return akk, aqk

        akk, aqk = jax.lax.fori_loop(0, SUB, offset, (akk, aqk))
        akk_ref[rs, :] = akk.astype(akk_ref.dtype)
        aqk_ref[rs, :] = aqk.astype(aqk_ref.dtype)
        return carry

    jax.lax.fori_loop(0, nb, strip, 0)
