"""Chunked KDA prefill in two Pallas kernels (Triton lowering); twin: `reference.kda_chunk_reference`.

1. `_intra_kernel`, grid (row, head, chunk), all chunks in parallel: cumulative decay G, the
   pairwise-decayed key-key and query-key matrices (every exponent is G_r - G_j with j <= r, so
   <= 0: no overflow for any gate), T = (I + L)^-1 by forward substitution, and the WY factors
   W = T diag(beta) (e^G * K), U = T diag(beta) V, plus q e^G, k e^(G_C - G) and e^(G_C).
2. `_inter_kernel`, grid (row, head, value block), sequential over chunks with the fp32 state
   block in registers: N = U - W S; O = (q e^G) S + A_qk N; S = e^(G_C) * S + (k e^(G_C - G))^T N.
   Value columns of the state evolve independently, so they split across programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._util import default_interpret, is_pow2
from pallas_kernels.kda.reference import validate_inputs
from pallas_kernels.kda.tuning import ChunkBlocks


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, *, scale):
    f32 = jnp.float32
    q = q_ref[...].astype(f32) * scale                   # [C, K]
    k = k_ref[...].astype(f32)
    v = v_ref[...].astype(f32)                           # [C, V]
    beta = b_ref[...].astype(f32)                        # [C]
    cum = jnp.cumsum(g_ref[...].astype(f32), axis=0)     # G_r
    c = q.shape[0]
    rows = jnp.arange(c)

    def column(j, carry):
        akk, aqk = carry
        pick = (rows == j)[:, None]
        k_j = jnp.sum(jnp.where(pick, k, 0.0), axis=0)
        g_j = jnp.sum(jnp.where(pick, cum, 0.0), axis=0)
        decay = jnp.exp(jnp.where(rows[:, None] >= j, cum - g_j[None, :], -jnp.inf))
        kd = k_j[None, :] * decay
        put = (rows == j)[None, :]
        akk = jnp.where(put, jnp.sum(k * kd, axis=1)[:, None], akk)
        aqk = jnp.where(put, jnp.sum(q * kd, axis=1)[:, None], aqk)
        return akk, aqk

    zeros = jnp.zeros((c, c), f32)
    akk, aqk = jax.lax.fori_loop(0, c, column, (zeros, zeros))
    lower = rows[:, None] > rows[None, :]
    akk = jnp.where(lower, akk * beta[:, None], 0.0)
    aqk = jnp.where(rows[:, None] >= rows[None, :], aqk, 0.0)

    def substitute(i, t):  # row i of (I + L)^-1 from the rows above it
        pick = (rows == i)[:, None]
        l_i = jnp.sum(jnp.where(pick, akk, 0.0), axis=0)
        t_i = jnp.where(rows == i, 1.0, 0.0) - jnp.sum(l_i[:, None] * t, axis=0)
        return jnp.where(pick, t_i[None, :], t)

    tri = jax.lax.fori_loop(0, c, substitute, zeros)
    e_cum = jnp.exp(cum)
    last = jnp.sum(jnp.where((rows == c - 1)[:, None], cum, 0.0), axis=0)
    w_ref[...] = jnp.dot(tri, beta[:, None] * e_cum * k, preferred_element_type=f32)
    u_ref[...] = jnp.dot(tri, beta[:, None] * v, preferred_element_type=f32)
    aqk_ref[...] = aqk
    qg_ref[...] = q * e_cum
    kt_ref[...] = k * jnp.exp(last[None, :] - cum)
    dec_ref[...] = jnp.exp(last)


def _inter_kernel(w_ref, u_ref, aqk_ref, qg_ref, kt_ref, dec_ref, s0_ref, o_ref, s_ref, *, n_chunks):
    f32 = jnp.float32

    def step(n, s):
        w, qg, kt = w_ref[n], qg_ref[n], kt_ref[n]            # [C, K]
        nu = u_ref[n] - jnp.dot(w, s, preferred_element_type=f32)                     # [C, Vb]
        o = jnp.dot(qg, s, preferred_element_type=f32) + jnp.dot(aqk_ref[n], nu, preferred_element_type=f32)
        o_ref[n] = o.astype(o_ref.dtype)
        return dec_ref[n][:, None] * s + jnp.dot(kt.T, nu, preferred_element_type=f32)

    s_ref[...] = jax.lax.fori_loop(0, n_chunks, step, s0_ref[...].astype(f32))


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret"))
def kda_chunk_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, blocks: ChunkBlocks = ChunkBlocks(),
                     interpret: bool | None = None):
    """Chunked KDA prefill; same contract as `kda_chunk_reference` (q, k L2-normalised)."""
    validate_inputs(q, k, v, g, beta, initial_state)
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    c = blocks.chunk
    if not (is_pow2(kd) and is_pow2(vd) and is_pow2(c)):
        raise ValueError(f"kda_chunk_pallas: K={kd}, V={vd} and the chunk {c} must be powers of two")
    scale = kd ** -0.5 if scale is None else scale
    interpret = default_interpret() if interpret is None else interpret
    n = -(-t // c)
    pad = n * c - t

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]; the tail pads with g = beta = 0 (a no-op)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, c, h, *x.shape[3:])
        return jnp.moveaxis(x, 3, 1)

    qc, kc, vc, gc, bc = chunks(q), chunks(k), chunks(v), chunks(g.astype(jnp.float32)), chunks(beta.astype(jnp.float32))
    s0 = jnp.zeros((b, h, kd, vd), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    f32 = jnp.float32
    blk = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda i, j, m: (i, j, m) + (0,) * len(tail))
    w, u, aqk, qg, kt, dec = pl.pallas_call(
        functools.partial(_intra_kernel, scale=scale),
        grid=(b, h, n),
        in_specs=[blk(c, kd), blk(c, kd), blk(c, vd), blk(c, kd), blk(c)],
        out_specs=[blk(c, kd), blk(c, vd), blk(c, c), blk(c, kd), blk(c, kd), blk(kd)],
        out_shape=[jax.ShapeDtypeStruct((b, h, n, c, kd), f32), jax.ShapeDtypeStruct((b, h, n, c, vd), f32),
                   jax.ShapeDtypeStruct((b, h, n, c, c), f32), jax.ShapeDtypeStruct((b, h, n, c, kd), f32),
                   jax.ShapeDtypeStruct((b, h, n, c, kd), f32), jax.ShapeDtypeStruct((b, h, n, kd), f32)],
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="kda_chunk_intra",
    )(qc, kc, vc, gc, bc)

    vb = min(vd, blocks.value_block)
    whole = lambda *tail: pl.BlockSpec((None, None) + tail, lambda i, j, m: (i, j) + (0,) * len(tail))
    by_value = lambda *tail: pl.BlockSpec((None, None) + tail[:-1] + (vb,),
                                          lambda i, j, m: (i, j) + (0,) * (len(tail) - 1) + (m,))
    o, s = pl.pallas_call(
        functools.partial(_inter_kernel, n_chunks=n),
        grid=(b, h, vd // vb),
        in_specs=[whole(n, c, kd), by_value(n, c, vd), whole(n, c, c), whole(n, c, kd), whole(n, c, kd),
                  whole(n, kd), by_value(kd, vd)],
        out_specs=[by_value(n, c, vd), by_value(kd, vd)],
        out_shape=[jax.ShapeDtypeStruct((b, h, n, c, vd), v.dtype), jax.ShapeDtypeStruct((b, h, kd, vd), f32)],
        compiler_params=plt.CompilerParams(num_warps=blocks.inter_num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="kda_chunk_inter",
    )(w, u, aqk, qg, kt, dec, s0)
    o = jnp.moveaxis(o.reshape(b, h, n * c, vd), 1, 2)[:, :t]
    return o, s
