"""The sequential KDA pass split in two (`ChunkBlocks(inter="split")`): a state-only pass, then the
outputs of every chunk in parallel. Same contract as `chunk.chunk_inter` (fixed-length rows).

1. `_state_kernel`, grid (row, head, value block), sequential over chunks: stores the state before
   each chunk, S_n [K, Vb], and N_n = U_n - W_n S_n; S <- e^(G_C) * S + (k e^(G_C - G))^T N_n. Each
   step reads W, U, k e^(G_C - G) only: the output products leave the sequential critical path.
2. `_output_kernel`, grid (row, head, chunk, value block), all chunks at once:
   O_n = (q e^G)_n S_n + A_qk,n N_n.

The per-chunk states and N are fp32 in HBM (T / C states of [K, V] per head: for T = 8192, C = 64,
K = V = 128 that is 8 MB per head written once and read once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _state_kernel(w_ref, u_ref, kt_ref, dec_ref, s0_ref, h_ref, nu_ref, s_ref, *, n_chunks: int):
    f32 = jnp.float32

    def step(n, s):
        h_ref[n] = s
        nu = u_ref[n] - jnp.dot(w_ref[n], s, preferred_element_type=f32)                 # [C, Vb]
        nu_ref[n] = nu
        return dec_ref[n][:, None] * s + jnp.dot(kt_ref[n].T, nu, preferred_element_type=f32)

    s_ref[...] = jax.lax.fori_loop(0, n_chunks, step, s0_ref[...].astype(f32))


def _output_kernel(qg_ref, aqk_ref, h_ref, nu_ref, o_ref):
    f32 = jnp.float32
    o = jnp.dot(qg_ref[...], h_ref[...], preferred_element_type=f32) + jnp.dot(aqk_ref[...], nu_ref[...],
                                                                              preferred_element_type=f32)
    o_ref[...] = o.astype(o_ref.dtype)


def chunk_inter_split(w, u, aqk, qg, kt, dec, s0, *, out_dtype, value_block: int, num_warps: int, num_stages: int,
                      interpret: bool):
    """-> (o [B, H, N, C, V] in out_dtype, final state [B, H, K, V] fp32). Factors as `chunk_intra`
    returns them, s0 [B, H, K, V]."""
    b, h, n, c, kd = w.shape
    vd = u.shape[-1]
    vb = min(vd, value_block)
    f32 = jnp.float32
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    whole = lambda *tail: pl.BlockSpec((None, None) + tail, lambda i, j, m: (i, j) + (0,) * len(tail))
    by_value = lambda *tail: pl.BlockSpec((None, None) + tail[:-1] + (vb,),
                                          lambda i, j, m: (i, j) + (0,) * (len(tail) - 1) + (m,))
    states, nu, s = pl.pallas_call(
        lambda *refs: _state_kernel(*refs, n_chunks=n),
        grid=(b, h, vd // vb),
        in_specs=[whole(n, c, kd), by_value(n, c, vd), whole(n, c, kd), whole(n, kd), by_value(kd, vd)],
        out_specs=[by_value(n, kd, vd), by_value(n, c, vd), by_value(kd, vd)],
        out_shape=[jax.ShapeDtypeStruct((b, h, n, kd, vd), f32), jax.ShapeDtypeStruct((b, h, n, c, vd), f32),
                   jax.ShapeDtypeStruct((b, h, kd, vd), f32)],
        compiler_params=params, interpret=interpret, name="kda_chunk_states",
    )(w, u, kt, dec, s0)
    chunk = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda i, j, m, v: (i, j, m) + (0,) * len(tail))
    chunk_v = lambda *tail: pl.BlockSpec((None, None, None) + tail[:-1] + (vb,),
                                         lambda i, j, m, v: (i, j, m) + (0,) * (len(tail) - 1) + (v,))
    o = pl.pallas_call(
        _output_kernel,
        grid=(b, h, n, vd // vb),
        in_specs=[chunk(c, kd), chunk(c, c), chunk_v(kd, vd), chunk_v(c, vd)],
        out_specs=chunk_v(c, vd),
        out_shape=jax.ShapeDtypeStruct((b, h, n, c, vd), out_dtype),
        compiler_params=params, interpret=interpret, name="kda_chunk_outputs",
    )(qg, aqk, states, nu)
    return o, s
