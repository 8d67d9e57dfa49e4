"""Pure-JAX references for the KDA recurrence (arch §4.3-4.4).

Per head, with state S [K, V] (fla layout), decay D_t = diag(exp(g_t)):

    S' = D_t S                      (decay first)
    nu = beta_t (v_t - S'^T k_t)     (delta-rule correction against the decayed state)
    S  = S' + k_t nu^T
    o_t = S^T (scale * q_t)          (read after the update)

Inputs follow fla's naive_recurrent_kda / naive_chunk_kda: q and k already L2-normalised, g the
per-channel log-space decay (<= 0), beta already passed through the sigmoid. Everything runs in
fp32; outputs are cast to v's dtype, the final state stays fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def validate_inputs(q, k, v, g, beta, initial_state=None) -> None:
    """Raises ValueError unless q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K], beta [B,T,H] and
    initial_state [B,H,K,V] agree."""
    if q.ndim != 4:
        raise ValueError(f"kda: q must be [B, T, H, K], got shape {q.shape}")
    b, t, h, kd = q.shape
    expected = {"k": (k, (b, t, h, kd)), "g": (g, (b, t, h, kd)), "beta": (beta, (b, t, h))}
    for name, (arr, shape) in expected.items():
        if tuple(arr.shape) != shape:
            raise ValueError(f"kda: {name} must have shape {shape}, got {tuple(arr.shape)}")
    if v.ndim != 4 or tuple(v.shape[:3]) != (b, t, h):
        raise ValueError(f"kda: v must be [B, T, H, V] = [{b}, {t}, {h}, V], got {tuple(v.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (b, h, kd, v.shape[-1]):
        raise ValueError(f"kda: initial_state must have shape {(b, h, kd, v.shape[-1])}, "
                         f"got {tuple(initial_state.shape)}")
    if t == 0:
        raise ValueError("kda: empty sequence (T = 0)")


def _prepare(q, k, v, g, beta, scale, initial_state):
    b, _, h, kd = q.shape
    scale = kd ** -0.5 if scale is None else scale
    f32 = lambda x: x.astype(jnp.float32)
    state = (jnp.zeros((b, h, kd, v.shape[-1]), jnp.float32) if initial_state is None
             else f32(initial_state))
    return f32(q) * scale, f32(k), f32(v), f32(g), f32(beta), state


def kda_recurrent_reference(q, k, v, g, beta, *, scale=None, initial_state=None):
    """Token-by-token KDA.

    Args:
      q, k: [B, T, H, K] L2-normalised. v: [B, T, H, V]. g: [B, T, H, K] log decay.
      beta: [B, T, H] in (0, 1). scale: q multiplier (default K**-0.5).
      initial_state: [B, H, K, V] or None (zeros).
    Returns:
      o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32.
    """
    validate_inputs(q, k, v, g, beta, initial_state)
    qf, kf, vf, gf, bf, state = _prepare(q, k, v, g, beta, scale, initial_state)

    def step(s_BHKV, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s_BHKV = s_BHKV * jnp.exp(g_t)[..., None]
        pred = jnp.einsum("bhk,bhkv->bhv", k_t, s_BHKV, precision=_HIGHEST)
        nu = b_t[..., None] * (v_t - pred)
        s_BHKV = s_BHKV + k_t[..., :, None] * nu[..., None, :]
        return s_BHKV, jnp.einsum("bhk,bhkv->bhv", q_t, s_BHKV, precision=_HIGHEST)

    time_major = lambda x: jnp.moveaxis(x, 1, 0)
    state, o = jax.lax.scan(step, state, tuple(map(time_major, (qf, kf, vf, gf, bf))))
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), state


def kda_chunk_reference(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=64):
    """Chunked (WY/UT) KDA; same contract as `kda_recurrent_reference`.

    Within a chunk of C tokens with inclusive cumulative decay G_r = sum_{s<=r} g_s and incoming
    state S0, the pseudo-values N solve (I + L) N = diag(beta) (V - (e^G * K) S0) with
    L[r, j] = beta_r sum_d k_r k_j e^(G_r - G_j) (j < r). Then
    O = (e^G * Q) S0 + A_qk N with A_qk[r, j] = sum_d q_r k_j e^(G_r - G_j) (j <= r), and
    S_C = e^(G_C) * S0 + (e^(G_C - G) * K)^T N. Every exponent is a difference G_r - G_j with
    j <= r (or G itself), hence <= 0: nothing overflows however negative the gates are.
    T need not be a multiple of C (the tail is padded with g = 0, beta = 0, a no-op).
    """
    validate_inputs(q, k, v, g, beta, initial_state)
    qf, kf, vf, gf, bf, state = _prepare(q, k, v, g, beta, scale, initial_state)
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


def kda_decode_reference(x_qkv, conv_state, conv_w, f, dt_bias, a, beta_logit, z, o_norm_w, state, *,
                         lower_bound=None, norm_eps=1e-5, scale=None):
    """One fused KDA decode step for a batch (arch §4.7): conv update + SiLU, q/k L2 norm, forget
    gate, beta, delta rule, sigmoid-gated RMSNorm. Same contract as `kda_decode` (the kernel).

    Args:
      x_qkv: [B, 3, H, K] this token's pre-conv q|k|v projections (activation dtype).
      conv_state: [B, W-1, 3, H, K] previous pre-conv inputs. conv_w: [W, 3, H, K] taps (fp32).
      f: [B, H, K] forget-gate logits before dt_bias. dt_bias: [H, K]. a: [H, K] = exp(A_log)
        broadcast to channels. beta_logit: [B, H]. z: [B, H, K] output-gate logits.
      o_norm_w: [K]. state: [B, H, K, V] fp32 (K == V).
      lower_bound: None for -a*softplus(f + dt_bias); else lower_bound * sigmoid(a * (f + dt_bias)).
    Returns:
      (out [B, H, K] in x_qkv's dtype, new conv_state, new state fp32)
    """
    dtype = x_qkv.dtype
    kd = x_qkv.shape[-1]
    scale = kd ** -0.5 if scale is None else scale
    window = jnp.concatenate([conv_state.astype(jnp.float32), x_qkv[:, None].astype(jnp.float32)], axis=1)
    pre = jnp.einsum("bwihk,wihk->bihk", window, conv_w.astype(jnp.float32), precision=_HIGHEST)
    act = jax.nn.silu(pre).astype(dtype).astype(jnp.float32)
    q, k, v = act[:, 0], act[:, 1], act[:, 2]
    q = q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6) * scale
    k = k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    u = f.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    if lower_bound is None:
        g = -a * jax.nn.softplus(u)
    else:
        g = lower_bound * jax.nn.sigmoid(a * u)
    beta = jax.nn.sigmoid(beta_logit.astype(jnp.float32))
    s = state.astype(jnp.float32) * jnp.exp(g)[..., None]
    pred = jnp.einsum("bhk,bhkv->bhv", k, s, precision=_HIGHEST)
    nu = beta[..., None] * (v - pred)
    s = s + k[..., :, None] * nu[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", q, s, precision=_HIGHEST).astype(dtype).astype(jnp.float32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + norm_eps) * o_norm_w.astype(jnp.float32)
    out = (o * jax.nn.sigmoid(z.astype(jnp.float32))).astype(dtype)
    new_conv = jnp.concatenate([conv_state[:, 1:], x_qkv[:, None].astype(conv_state.dtype)], axis=1)
    return out, new_conv, s
