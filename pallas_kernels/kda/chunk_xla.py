"""Chunked KDA in pure JAX (the WY / UT form, arch §4.4): the production multi-token path off the
GPU, and the twin of the Pallas prefill kernels in `chunk.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda.reference import prepare_fp32, validate_inputs

_HIGHEST = jax.lax.Precision.HIGHEST


def kda_chunk_xla(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=64):
    """Chunked (WY/UT) KDA in pure JAX; same contract as `kda_recurrent_reference`.

    Within a chunk of C tokens with inclusive cumulative decay G_r = sum_{s<=r} g_s and incoming
    state S0, the pseudo-values N solve (I + L) N = diag(beta) (V - (e^G * K) S0) with
    L[r, j] = beta_r sum_d k_r k_j e^(G_r - G_j) (j < r). Then
    O = (e^G * Q) S0 + A_qk N with A_qk[r, j] = sum_d q_r k_j e^(G_r - G_j) (j <= r), and
    S_C = e^(G_C) * S0 + (e^(G_C - G) * K)^T N. Every exponent is a difference G_r - G_j with
    j <= r (or G itself), hence <= 0: nothing overflows however negative the gates are.
    T need not be a multiple of C (the tail is padded with g = 0, beta = 0, a no-op).
    """
    validate_inputs(q, k, v, g, beta, initial_state)
    qf, kf, vf, gf, bf, state = prepare_fp32(q, k, v, g, beta, scale, initial_state)
    b, t, h, kd = q.shape
    c = int(chunk_size)
    n = -(-t // c)
    pad = n * c - t

    def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, c, h, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    incl = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)

    def step(s0, xs):
        q_c, k_c, v_c, g_c, b_c = xs                        # [B,H,C,K], .., [B,H,C,V], [B,H,C,K], [B,H,C]
        cum = jnp.cumsum(g_c, axis=2)                       # G_r
        diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [B,H,C(r),C(j),K] = G_r - G_j
        decay = jnp.exp(jnp.where(incl[:, :, None], diff, -jnp.inf))
        kk = jnp.einsum("bhrk,bhjk,bhrjk->bhrj", k_c, k_c, decay, precision=_HIGHEST)
        l_mat = jnp.where(strict, kk * b_c[..., None], 0.0)
        a_qk = jnp.einsum("bhrk,bhjk,bhrjk->bhrj", q_c, k_c, decay, precision=_HIGHEST)
        kg = k_c * jnp.exp(cum)
        rhs = b_c[..., None] * (v_c - jnp.einsum("bhck,bhkv->bhcv", kg, s0, precision=_HIGHEST))
        nu = jax.lax.linalg.triangular_solve(l_mat, rhs, left_side=True, lower=True, unit_diagonal=True)
        o_c = (jnp.einsum("bhck,bhkv->bhcv", q_c * jnp.exp(cum), s0, precision=_HIGHEST)
               + jnp.einsum("bhrj,bhjv->bhrv", a_qk, nu, precision=_HIGHEST))
        last = cum[:, :, -1, :]                             # G_C [B,H,K]
        k_tail = k_c * jnp.exp(last[:, :, None, :] - cum)
        s1 = s0 * jnp.exp(last)[..., None] + jnp.einsum("bhck,bhcv->bhkv", k_tail, nu, precision=_HIGHEST)
        return s1, o_c

    state, o = jax.lax.scan(step, state, tuple(map(chunks, (qf, kf, vf, gf, bf))))
    o = jnp.moveaxis(o, 0, 1)                               # [B, N, H, C, V]
    o = jnp.moveaxis(o, 3, 2).reshape(b, n * c, h, v.shape[-1])[:, :t]
    return o.astype(v.dtype), state
