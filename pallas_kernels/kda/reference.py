"""Pure-JAX references for the KDA recurrence (arch §4.3-4.4).

Per head, with state S [K, V] (fla layout), decay D_t = diag(exp(g_t)):

    S' = D_t S                      (decay first)
    nu = beta_t (v_t - S'^T k_t)     (delta-rule correction against the decayed state)
    S  = S' + k_t nu^T
    o_t = S^T (scale * q_t)          (read after the update)

Inputs follow fla's naive_recurrent_kda / naive_chunk_kda: q and k already L2-normalised, g the
per-channel log-space decay (<= 0), beta already passed through the sigmoid. Everything runs in
fp32; outputs are cast to v's dtype, the final state stays fp32. `kda_recurrent_reference` is THE
reference: the chunked forms (`chunk_xla.kda_chunk_xla`, the Pallas kernels) are tested against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def validate_varlen(q, k, v, g, beta, cu_seqlens, initial_state=None) -> None:
    """`validate_inputs` for one packed row of S sequences: cu_seqlens [S + 1] integer offsets, checked
    to rise from 0 to T when concrete; initial_state [S, H, K, V]."""
    validate_inputs(q, k, v, g, beta)
    _, t, h, kd = q.shape
    if q.shape[0] != 1:
        raise ValueError(f"kda varlen: sequences are packed in one row, so B must be 1; got q {q.shape}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2 or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(f"kda varlen: cu_seqlens must be an integer [S + 1] array with S >= 1, got "
                         f"{cu_seqlens.dtype}{list(cu_seqlens.shape)}")
    seqs = cu_seqlens.shape[0] - 1
    if initial_state is not None and tuple(initial_state.shape) != (seqs, h, kd, v.shape[-1]):
        raise ValueError(f"kda varlen: initial_state must have shape {(seqs, h, kd, v.shape[-1])}, "
                         f"got {tuple(initial_state.shape)}")
    try:
        cu = np.asarray(cu_seqlens)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return                                  # traced: the values are the caller's to get right
    if cu[0] != 0 or cu[-1] != t or np.any(np.diff(cu) < 0):
        raise ValueError(f"kda varlen: cu_seqlens must rise from 0 to T = {t} without decreasing, got {cu.tolist()}")


def prepare_fp32(q, k, v, g, beta, scale, initial_state):
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
    qf, kf, vf, gf, bf, state = prepare_fp32(q, k, v, g, beta, scale, initial_state)

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


def kda_varlen_reference(q, k, v, g, beta, cu_seqlens, *, scale=None, initial_state=None):
    """Token-by-token KDA over S sequences packed in one row: the state restarts from sequence i's
    initial state at token cu[i] and is kept as its final state after token cu[i+1] - 1.

    Args: as `pallas_kernels.kda.varlen.kda_varlen_pallas` (q [1, T, H, K], cu_seqlens [S + 1],
      initial_state [S, H, K, V] or None).
    Returns:
      o [1, T, H, V] in v.dtype, final states [S, H, K, V] fp32 (length 0: the initial state).
    """
    validate_varlen(q, k, v, g, beta, cu_seqlens, initial_state)
    seqs = cu_seqlens.shape[0] - 1
    _, t, h, kd = q.shape
    init = (jnp.zeros((seqs, h, kd, v.shape[-1]), jnp.float32) if initial_state is None
            else jnp.asarray(initial_state, jnp.float32))
    qf, kf, vf, gf, bf, _ = (x[0] for x in prepare_fp32(q, k, v, g, beta, scale, None))
    cu = cu_seqlens.astype(jnp.int32)
    token = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], token, side="right").astype(jnp.int32)
    starts, ends = token == cu[seq], token == cu[seq + 1] - 1

    def step(carry, xs):
        s_HKV, finals = carry
        q_t, k_t, v_t, g_t, b_t, seq_t, start_t, end_t = xs
        s_HKV = jnp.where(start_t, init[seq_t], s_HKV) * jnp.exp(g_t)[..., None]
        nu = b_t[..., None] * (v_t - jnp.einsum("hk,hkv->hv", k_t, s_HKV, precision=_HIGHEST))
        s_HKV = s_HKV + k_t[..., :, None] * nu[..., None, :]
        finals = jnp.where(end_t, finals.at[seq_t].set(s_HKV), finals)
        return (s_HKV, finals), jnp.einsum("hk,hkv->hv", q_t, s_HKV, precision=_HIGHEST)

    (_, finals), o = jax.lax.scan(step, (init[0], init), (qf, kf, vf, gf, bf, seq, starts, ends))
    return o[None].astype(v.dtype), finals
