"""Kimi Delta Attention layer (arch §4): projections, short causal conv + SiLU, q/k L2 norm,
forget gate, beta, the delta-rule recurrence (via `pallas_kernels.kda`), sigmoid-gated output
norm and o_proj.

Checkpoint names under `self_attn.`: q/k/v_proj, q/k/v_conv1d, f_a_proj, f_b_proj, b_proj, A_log,
dt_bias, g_a_proj + g_b_proj (Kimi-Linear) or g_proj (K3), o_norm, o_proj.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import KDAConfig
from k3jax.layers.linear import Linear, linears, takes_fused_kernel
from k3jax.layers.norms import GatedRMSNorm
from k3jax.layers.params import normal, param, uniform
from k3jax.state import KDAPending, KDAState, SeqInfo
from pallas_kernels.kda import (DecodeBlocks, KDADecodeInputs, KDADecodeWeights, kda, kda_decode, kda_decode_steps,
                                kda_verify_outputs)
from pallas_kernels.kda import forget_gate as gate_from_logits
from pallas_kernels.skinny import SkinnyImpl, fused_projections


def head_or_channel(a_log: jax.Array, cfg: KDAConfig) -> jax.Array:
    """A_log [H] or [K] as fp32 [H, 1] (per head) or [1, K] (per channel), to broadcast against
    [..., H, K]."""
    a_log = a_log.astype(jnp.float32)
    return a_log[:, None] if cfg.a_log_policy == "per_head" else a_log[None, :]


def decay_rates(a_log: jax.Array, cfg: KDAConfig) -> jax.Array:
    """a = exp(A_log) shaped to broadcast against [..., H, K]: [H, 1] per head or [1, K] per channel."""
    return jnp.exp(head_or_channel(a_log, cfg))


def grouped_projections(x_BTD: jax.Array, groups) -> list[jax.Array]:
    """x through each group of layers: per group one array [B, T, sum of out], its layers' outputs
    side by side. As `linears` on groups that share x, but on the few-row path each group's array is
    the fused kernel's own output, not cut into per-layer pieces to be joined again."""
    calls = [(x_BTD, layers) for layers in groups]
    if not takes_fused_kernel(calls):
        return [jnp.concatenate(pieces, axis=-1) for pieces in linears(calls)]
    x = x_BTD.reshape(-1, x_BTD.shape[-1]).astype(groups[0][0].kernel.dtype)
    outs = fused_projections([(x, tuple(lin.kernel[...] for lin in layers)) for layers in groups], impl="pallas")
    return [out.reshape(x_BTD.shape[:-1] + out.shape[-1:]) for out in outs]


def forget_gate(f_BTHK: jax.Array, a_log: jax.Array, dt_bias_HK: jax.Array, cfg: KDAConfig) -> jax.Array:
    """Log-space per-channel decay g [B, T, H, K] in fp32 (arch §4.5; formulas in
    `pallas_kernels.kda.gate`): -a * softplus(f + dt_bias) (Kimi-Linear) or
    lower_bound * sigmoid(a * (f + dt_bias)) (K3), a = exp(A_log) per head or per channel."""
    u = f_BTHK.astype(jnp.float32) + dt_bias_HK.astype(jnp.float32)
    return gate_from_logits(u, decay_rates(a_log, cfg), cfg.gate_lower_bound)


def short_conv(x_BTC: jax.Array, state_BWC: jax.Array, w_WC: jax.Array, pad_B: jax.Array):
    """Depthwise causal conv over left-padded rows, continuing from a cached window.

    Tap W-1 multiplies the current token. Row b's history (the cached W-1 inputs) is placed
    directly before its first real token, so padding never enters a real token's window.

    Args:
      x_BTC: pre-conv inputs, zero at padding. state_BWC: [B, W-1, C] previous inputs.
      w_WC: [W, C] fp32 taps. pad_B: [B] left pads.
    Returns:
      (y_BTC fp32 before the activation, new state [B, W-1, C] in x's dtype).
    """
    b, t, c = x_BTC.shape
    w = w_WC.shape[0]
    seq = jnp.concatenate([state_BWC.astype(x_BTC.dtype), x_BTC, jnp.zeros((b, 1, c), x_BTC.dtype)], axis=1)
    p = jnp.arange(w - 1 + t)[None, :]
    pad = pad_B[:, None]
    zero_slot = w - 1 + t
    src = jnp.where(p >= pad + w - 1, p, jnp.where(p >= pad, p - pad, zero_slot))
    aligned = jnp.take_along_axis(seq, src[:, :, None], axis=1)            # [B, W-1+T, C]
    af = aligned.astype(jnp.float32)
    wf = w_WC.astype(jnp.float32)
    y = sum(af[:, j:j + t, :] * wf[j] for j in range(w))
    return y, aligned[:, t:, :]


class KimiDeltaAttention(nnx.Module):
    """KDA mixer. x [B, T, D] (the normed layer input) -> [B, T, D]."""

    def __init__(self, cfg: KDAConfig, *, dtype, rngs: nnx.Rngs, linear_impl: SkinnyImpl = "auto"):
        self.cfg = cfg
        d, h, k, p, w = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.proj_size, cfg.conv_size
        lin = lambda i, o, axes: Linear(i, o, dtype=dtype, axes=axes, rngs=rngs, impl=linear_impl)
        self.q_proj = lin(d, p, ("embed", "kda_proj"))
        self.k_proj = lin(d, p, ("embed", "kda_proj"))
        self.v_proj = lin(d, p, ("embed", "kda_proj"))
        conv = lambda: param(rngs, (w, p), jnp.float32, normal(0.5), ("conv_width", "kda_proj"))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(), conv(), conv()
        self.f_a_proj = lin(d, k, ("embed", "head_dim"))
        self.f_b_proj = lin(k, p, ("head_dim", "kda_proj"))
        self.b_proj = lin(d, h, ("embed", "kda_heads"))
        a_len = h if cfg.a_log_policy == "per_head" else k
        self.A_log = param(rngs, (a_len,), jnp.float32,
                           lambda key, s, dt: jnp.log(jax.random.uniform(key, s, dt, 1.0, 16.0)), ("a_log",))
        self.dt_bias = param(rngs, (p,), jnp.float32, uniform(-4.0, -2.0), ("kda_proj",))
        if cfg.use_full_rank_gate:
            self.g_proj = lin(d, p, ("embed", "kda_proj"))
        else:
            self.g_a_proj = lin(d, k, ("embed", "head_dim"))
            self.g_b_proj = lin(k, p, ("head_dim", "kda_proj"))
        self.o_norm = GatedRMSNorm(k, cfg.norm_eps, rngs=rngs)
        self.o_proj = lin(p, d, ("kda_proj", "embed"))

    def __call__(self, x_BTD: jax.Array, seq: SeqInfo, state: KDAState | None, *, fresh: bool = False,
                 partial: bool = False):
        """Returns (out [B, T, D], new KDAState or None when `state` is None).

        `fresh` (no history) needs no special path here: a fresh state is all zeros. partial: out
        may be o_proj's fp32 partial sums (`Linear(partial=True)`) for the residual add to sum."""
        cfg = self.cfg
        b, t, _ = x_BTD.shape
        h, k, p = cfg.num_heads, cfg.head_dim, cfg.proj_size
        dtype = x_BTD.dtype
        valid = seq.valid[:, :, None]

        mixed, proj = self._projections(x_BTD)
        mixed = jnp.where(valid, mixed, 0).astype(dtype)
        conv_state = (jnp.zeros((b, cfg.conv_size - 1, 3 * p), dtype) if state is None else state.conv)
        if state is not None and seq.tentative:
            return self._verify(x_BTD, mixed, proj, state, partial=partial)
        if t == 1 and state is not None:
            return self._decode_step(x_BTD, mixed, proj, state, partial=partial)
        pre, new_conv = short_conv(mixed, conv_state, self._taps(), seq.pad)
        act = jax.nn.silu(pre).astype(dtype)
        q, kk, v = (act[..., i * p:(i + 1) * p].reshape(b, t, h, k) for i in range(3))

        f_logits, beta_logits, z = proj
        g = forget_gate(f_logits.reshape(b, t, h, k), self.A_log[...], self.dt_bias[...].reshape(h, k), cfg)
        g = jnp.where(valid[..., None], g, 0.0)
        beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))
        beta = jnp.where(valid, beta, 0.0)

        o, s = kda(q, kk, v, g, beta, scale=k ** -0.5, normalize_qk=True,
                   initial_state=None if state is None else state.recurrent.astype(jnp.float32),
                   impl=cfg.impl, chunk_size=cfg.chunk_size)

        out = self.o_norm(o, z.reshape(b, t, h, k), dtype).reshape(b, t, p)
        out = self.o_proj(out, partial=partial)
        return out, (None if state is None else KDAState(conv=new_conv, recurrent=s.astype(state.recurrent.dtype)))

    def _projections(self, x_BTD):
        """Every projection of the layer input: (mixed [B, T, 3P] = q|k|v before the conv, and
        (decay logits f [B, T, P], beta logits [B, T, H], output-gate logits z [B, T, P])).
        On the few-row (decode) path they take two launches: everything that reads x (q|k|v coming
        out as one array), then the low-rank second halves."""
        gate = self.g_proj if self.cfg.use_full_rank_gate else self.g_a_proj
        mixed, f_a, beta, g_first = grouped_projections(
            x_BTD, [[self.q_proj, self.k_proj, self.v_proj], [self.f_a_proj], [self.b_proj], [gate]])
        if self.cfg.use_full_rank_gate:
            (f,), = linears([(f_a, [self.f_b_proj])])
            z = g_first
        else:
            (f,), (z,) = linears([(f_a, [self.f_b_proj]), (g_first, [self.g_b_proj])])
        return mixed, (f, beta, z)

    def _decode_inputs(self, mixed_BTC, proj) -> KDADecodeInputs:
        """The fused decode step's per-token inputs, with the token axis: x_qkv [B, T, 3, H, K], ..."""
        cfg = self.cfg
        b, t, h, k = mixed_BTC.shape[0], mixed_BTC.shape[1], cfg.num_heads, cfg.head_dim
        f, beta, z = proj
        return KDADecodeInputs(x_qkv=mixed_BTC.reshape(b, t, 3, h, k), f=f.reshape(b, t, h, k), beta_logit=beta,
                               z=z.reshape(b, t, h, k))

    def _decode_weights(self) -> KDADecodeWeights:
        """The layer's weights as the fused decode step reads them: every array a reshape of a
        parameter (nothing concatenated or broadcast per step)."""
        cfg = self.cfg
        h, k, w = cfg.num_heads, cfg.head_dim, cfg.conv_size
        taps = lambda conv: conv[...].reshape(w, h, k)
        return KDADecodeWeights(
            q_conv=taps(self.q_conv1d), k_conv=taps(self.k_conv1d), v_conv=taps(self.v_conv1d),
            dt_bias=self.dt_bias[...].reshape(h, k), a_log=head_or_channel(self.A_log[...], cfg),
            o_norm_w=self.o_norm.weight[...], lower_bound=cfg.gate_lower_bound, norm_eps=cfg.norm_eps, scale=k ** -0.5)

    def _taps(self) -> jax.Array:
        """[W, 3P] q | k | v conv taps side by side (the prefill conv)."""
        return jnp.concatenate([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]], axis=-1)

    def _decode_blocks(self) -> DecodeBlocks | None:
        """The one-token kernel's launch settings: for "pallas" cfg.decode_split column blocks per head;
        the other impls take their defaults."""
        if self.cfg.decode_impl != "pallas":
            return None
        split = self.cfg.decode_split
        return DecodeBlocks(value_blocks=0 if split == "auto" else int(split))

    def _decode_step(self, x_BTD, mixed_BTC, proj, state: KDAState, *, partial: bool = False):
        """One token per row through the fused decode step (`kda_decode`, impl cfg.decode_impl)."""
        cfg = self.cfg
        b, h, k, w = x_BTD.shape[0], cfg.num_heads, cfg.head_dim, cfg.conv_size
        inputs = jax.tree.map(lambda a: a[:, 0], self._decode_inputs(mixed_BTC, proj))
        out, conv, s = kda_decode(inputs, self._decode_weights(), state.conv.reshape(b, w - 1, 3, h, k),
                                  state.recurrent, impl=cfg.decode_impl, blocks=self._decode_blocks())
        out = self.o_proj(out.reshape(b, 1, h * k), partial=partial)
        return out, KDAState(conv=conv.reshape(b, w - 1, 3 * h * k), recurrent=s)

    def _verify(self, x_BTD, mixed_BTC, proj, state: KDAState, *, partial: bool = False):
        """A speculative window of T tokens per row: the outputs of T fused decode steps (exactly
        what decoding them one by one gives) and a KDAPending to commit any prefix of them."""
        cfg = self.cfg
        b, t, h, k, w = *x_BTD.shape[:2], cfg.num_heads, cfg.head_dim, cfg.conv_size
        inputs = self._decode_inputs(mixed_BTC, proj)
        out = kda_verify_outputs(inputs, self._decode_weights(), state.conv.reshape(b, w - 1, 3, h, k),
                                 state.recurrent, impl=cfg.decode_impl)
        out = self.o_proj(out.reshape(b, t, h * k), partial=partial)
        return out, KDAPending(inputs=inputs, conv=state.conv, recurrent=state.recurrent)

    def commit(self, pending: KDAPending, keep_B: jax.Array) -> KDAState:
        """The state after the first keep_B[b] tokens of a verify window (0 keeps the old state),
        replayed through the same fused steps as decoding."""
        cfg = self.cfg
        b, h, k, w = pending.conv.shape[0], cfg.num_heads, cfg.head_dim, cfg.conv_size
        _, conv, s = kda_decode_steps(pending.inputs, self._decode_weights(),
                                      pending.conv.reshape(b, w - 1, 3, h, k), pending.recurrent, keep=keep_B,
                                      impl=cfg.decode_impl)
        return KDAState(conv=conv.reshape(b, w - 1, 3 * h * k), recurrent=s)
