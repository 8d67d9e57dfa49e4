"""Layer math against independent numpy formulations and alternative forms."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_close

from k3jax.config import Activation, KDAConfig, MoEConfig
from k3jax.layers.kda import KimiDeltaAttention, forget_gate, short_conv
from k3jax.layers.mla_attention import attention_absorbed, attention_naive
from k3jax.layers.mlp import gated_activation
from k3jax.layers.moe import experts_dense, experts_gather, experts_ragged, route
from k3jax.state import KDAState, SeqInfo


def test_softplus_gate_formula(rng):
    cfg = KDAConfig(hidden_size=8, num_heads=3, head_dim=4)
    f = rng.standard_normal((2, 5, 3, 4)).astype(np.float32) * 10
    a_log = rng.standard_normal(3).astype(np.float32)
    dt = rng.standard_normal((3, 4)).astype(np.float32)
    u = f.astype(np.float64) + dt
    expected = -np.exp(a_log)[:, None] * np.logaddexp(0.0, u)
    assert_close("g", forget_gate(f, a_log, dt, cfg), expected)


def test_bounded_gate_formula(rng):
    cfg = KDAConfig(hidden_size=8, num_heads=3, head_dim=4, gate_lower_bound=-5.0)
    f = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    a_log = rng.standard_normal(3).astype(np.float32)
    dt = rng.standard_normal((3, 4)).astype(np.float32)
    expected = -5.0 / (1.0 + np.exp(-np.exp(a_log)[:, None] * (f + dt)))
    assert_close("g", forget_gate(f, a_log, dt, cfg), expected)


def test_short_conv_matches_direct_convolution(rng):
    b, t, c, w = 2, 7, 5, 4
    x = rng.standard_normal((b, t, c)).astype(np.float32)
    state = rng.standard_normal((b, w - 1, c)).astype(np.float32)
    taps = rng.standard_normal((w, c)).astype(np.float32)
    y, new_state = short_conv(jnp.asarray(x), jnp.asarray(state), jnp.asarray(taps), jnp.zeros((b,), jnp.int32))
    hist = np.concatenate([state, x], axis=1)
    expected = np.stack([sum(taps[j] * hist[:, s + j] for j in range(w)) for s in range(t)], axis=1)
    assert_close("y", y, expected)
    np.testing.assert_array_equal(new_state, hist[:, -(w - 1):])


def test_short_conv_left_padding_keeps_history_adjacent(rng):
    """A row padded by p gives the same outputs as the unpadded row shifted by p."""
    t, c, w, p = 6, 3, 4, 2
    x = rng.standard_normal((1, t - p, c)).astype(np.float32)
    state = rng.standard_normal((1, w - 1, c)).astype(np.float32)
    taps = rng.standard_normal((w, c)).astype(np.float32)
    y_ref, s_ref = short_conv(x, state, taps, jnp.zeros((1,), jnp.int32))
    padded = np.concatenate([np.zeros((1, p, c), np.float32), x], axis=1)
    y_pad, s_pad = short_conv(padded, state, taps, jnp.full((1,), p, jnp.int32))
    assert_close("y", y_pad[:, p:], y_ref)
    assert_close("state", s_pad, s_ref)


def _kda_layer(rng_seed=0, **cfg_changes):
    cfg = KDAConfig(hidden_size=32, num_heads=2, head_dim=8, chunk_size=8, **cfg_changes)
    return KimiDeltaAttention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(rng_seed))


def _fresh_kda_state(layer, b):
    cfg = layer.cfg
    return KDAState(conv=jnp.zeros((b, cfg.conv_size - 1, 3 * cfg.proj_size)),
                    recurrent=jnp.zeros((b, cfg.num_heads, cfg.head_dim, cfg.head_dim)))


def test_kda_layer_chunked_equals_recurrent_and_continues(rng):
    layer = _kda_layer()
    x = jnp.asarray(rng.standard_normal((2, 21, 32)), jnp.float32)
    seq = SeqInfo.make(jnp.ones((2, 21), bool))
    out_c, st_c = layer(x, seq, _fresh_kda_state(layer, 2))
    layer_r = _kda_layer()
    layer_r.cfg = dataclasses.replace(layer_r.cfg, impl="recurrent")
    out_r, st_r = layer_r(x, seq, _fresh_kda_state(layer, 2))
    assert_close("out", out_c, out_r)
    assert_close("state", st_c.recurrent, st_r.recurrent)
    # Continuation: 13 tokens, then 8 more from the carried conv + recurrent state.
    o1, s1 = layer(x[:, :13], SeqInfo.make(jnp.ones((2, 13), bool)), _fresh_kda_state(layer, 2))
    o2, s2 = layer(x[:, 13:], SeqInfo.make(jnp.ones((2, 8), bool)), s1)
    assert_close("continued out", jnp.concatenate([o1, o2], axis=1), out_c)
    assert_close("continued state", s2.recurrent, st_c.recurrent)
    np.testing.assert_allclose(s2.conv, st_c.conv, rtol=0, atol=0)


def test_kda_layer_left_padding_is_a_no_op(rng):
    layer = _kda_layer(gate_lower_bound=-5.0, use_full_rank_gate=True)
    x = jnp.asarray(rng.standard_normal((1, 9, 32)), jnp.float32)
    alone, st_alone = layer(x, SeqInfo.make(jnp.ones((1, 9), bool)), _fresh_kda_state(layer, 1))
    garbage = jnp.asarray(rng.standard_normal((1, 4, 32)) * 100, jnp.float32)
    padded_x = jnp.concatenate([garbage, x], axis=1)
    valid = jnp.concatenate([jnp.zeros((1, 4), bool), jnp.ones((1, 9), bool)], axis=1)
    padded, st_pad = layer(padded_x, SeqInfo.make(valid), _fresh_kda_state(layer, 1))
    assert_close("out", padded[:, 4:], alone)
    assert_close("state", st_pad.recurrent, st_alone.recurrent)
    assert_close("conv", st_pad.conv, st_alone.conv)


def test_mla_absorbed_equals_naive(rng):
    b, t, s, h, n, p, r, v = 2, 3, 11, 4, 16, 8, 12, 10
    q_nope = jnp.asarray(rng.standard_normal((b, t, h, n)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((b, t, h, p)), jnp.float32)
    latent = jnp.asarray(rng.standard_normal((b, s, r + p)), jnp.float32)
    w_kv_b = jnp.asarray(rng.standard_normal((r, h * (n + v))) / np.sqrt(r), jnp.float32)
    lengths = np.array([[5, 6, 7], [9, 10, 11]])
    mask = jnp.arange(s)[None, None, :] < lengths[:, :, None]
    kw = dict(scale=(n + p) ** -0.5, v_dim=v)
    naive = attention_naive(q_nope, q_pe, latent, w_kv_b, mask, **kw)
    absorbed = attention_absorbed(q_nope, q_pe, latent, w_kv_b, mask, **kw)
    assert_close("absorbed vs naive", absorbed, naive)
    # And against a plain numpy softmax attention with the per-head keys expanded by hand.
    c, kpe = np.asarray(latent[..., :r], np.float64), np.asarray(latent[..., r:], np.float64)
    w = np.asarray(w_kv_b, np.float64).reshape(r, h, n + v)
    keys = np.concatenate([np.einsum("bsr,rhn->bshn", c, w[..., :n]), np.repeat(kpe[:, :, None], h, 2)], -1)
    vals = np.einsum("bsr,rhv->bshv", c, w[..., n:])
    q = np.concatenate([q_nope, q_pe], -1).astype(np.float64)
    sc = np.einsum("bthd,bshd->bhts", q, keys) * (n + p) ** -0.5
    sc = np.where(np.asarray(mask)[:, None], sc, -np.inf)
    pr = np.exp(sc - sc.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    assert_close("naive vs numpy", naive, np.einsum("bhts,bshv->bthv", pr, vals))


def _numpy_route(x, w, bias, cfg: MoEConfig):
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ w.astype(np.float64))))
    choice = scores + bias
    if cfg.num_expert_group > 1:
        g = choice.reshape(len(x), cfg.num_expert_group, -1)
        group_score = np.sort(g, -1)[..., -2:].sum(-1)
        keep = np.argsort(-group_score, -1)[:, :cfg.topk_group]
        mask = np.zeros(group_score.shape, bool)
        np.put_along_axis(mask, keep, True, -1)
        choice = np.where(mask[..., None], g, -np.inf).reshape(len(x), -1)
    idx = np.argsort(-choice, -1)[:, :cfg.num_experts_per_token]
    wts = np.take_along_axis(scores, idx, -1)
    if cfg.renormalize:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    return wts * cfg.routed_scaling_factor, idx


@pytest.mark.parametrize("groups,topk_group,renorm", [(1, 1, True), (4, 2, True), (2, 1, False)])
def test_router_matches_numpy(rng, groups, topk_group, renorm):
    cfg = MoEConfig(hidden_size=16, num_experts=16, num_experts_per_token=3, expert_intermediate_size=8,
                    num_expert_group=groups, topk_group=topk_group, renormalize=renorm, routed_scaling_factor=2.446)
    x = rng.standard_normal((40, 16)).astype(np.float32)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    bias = (rng.standard_normal(16) * 0.5).astype(np.float32)
    weights, experts = route(x, w, bias, cfg)
    ref_w, ref_idx = _numpy_route(x, w, bias, cfg)
    order = np.argsort(np.asarray(experts), -1)
    ref_order = np.argsort(ref_idx, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, -1),
                                  np.take_along_axis(ref_idx, ref_order, -1))
    assert_close("weights", np.take_along_axis(np.asarray(weights), order, -1),
                 np.take_along_axis(ref_w, ref_order, -1))


@pytest.mark.parametrize("act", [Activation("silu"), Activation("situ", 4.0, 25.0)])
def test_ragged_experts_equal_dense_reference(rng, act):
    n, d, f, e, k = 37, 16, 8, 6, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (n, k)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) / 4, jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
    dense = experts_dense(x, weights, experts, *ws, act)
    assert_close("ragged vs dense", experts_ragged(x, weights, experts, *ws, act), dense)
    assert_close("gather vs dense", experts_gather(x, weights, experts, *ws, act), dense)
    # Independent loop over tokens.
    ref = np.zeros((n, d))
    for i in range(n):
        for j in range(k):
            ei = int(experts[i, j])
            h = np.asarray(gated_activation(x[i] @ ws[0][ei], x[i] @ ws[1][ei], act), np.float64)
            ref[i] += float(weights[i, j]) * (h @ np.asarray(ws[2][ei], np.float64))
    assert_close("dense vs loop", dense, ref)


def test_situ_formula(rng):
    gate = rng.standard_normal(50).astype(np.float32) * 10
    up = rng.standard_normal(50).astype(np.float32) * 60
    expected = 4 * np.tanh(gate / 4) / (1 + np.exp(-gate)) * 25 * np.tanh(up / 25)
    assert_close("situ", gated_activation(gate, up, Activation("situ", 4.0, 25.0)), expected)
    assert_close("silu", gated_activation(gate, up, Activation("silu")), gate / (1 + np.exp(-gate)) * up)
