"""The KDA layer: gate formulas, the short causal conv, chunked == recurrent, continuation, left
padding, and the fused decode step against the sequence path."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_close

from k3jax.config import KDAConfig
from k3jax.layers.kda import KimiDeltaAttention, forget_gate, short_conv
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



def test_per_channel_gate_formula(rng):
    cfg = KDAConfig(hidden_size=8, num_heads=3, head_dim=4, gate_lower_bound=-5.0, a_log_policy="per_channel")
    f = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    a_log = rng.standard_normal(4).astype(np.float32)
    dt = rng.standard_normal((3, 4)).astype(np.float32)
    expected = -5.0 / (1.0 + np.exp(-np.exp(a_log)[None, :] * (f + dt)))
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
    cfg = KDAConfig(**{"hidden_size": 32, "num_heads": 2, "head_dim": 8, "chunk_size": 8, **cfg_changes})
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



@pytest.mark.parametrize("decode_impl,cfg_changes", [
    ("xla", {}), ("pallas", {}), ("xla", {"gate_lower_bound": -5.0, "use_full_rank_gate": True}),
    ("pallas", {"gate_lower_bound": -5.0, "use_full_rank_gate": True}),
    ("hopper", {"head_dim": 128}),                 # the Mosaic GPU step: conv and gates inside at K = 128
    ("hopper", {"head_dim": 64, "gate_lower_bound": -5.0, "use_full_rank_gate": True})])   # ... before it at 64
def test_fused_decode_step_equals_the_sequence_path(rng, decode_impl, cfg_changes):
    """A one-token step through `kda_decode` equals the same token through the multi-token path."""
    layer = _kda_layer(**cfg_changes)
    x = jnp.asarray(rng.standard_normal((2, 7, 32)), jnp.float32)
    _, state = layer(x[:, :6], SeqInfo.make(jnp.ones((2, 6), bool)), _fresh_kda_state(layer, 2))
    step = _kda_layer(**cfg_changes, decode_impl=decode_impl)
    out, st = jax.block_until_ready(step(x[:, 6:], SeqInfo.make(jnp.ones((2, 1), bool)), state))  # interpreted
    seq = _kda_layer(**cfg_changes, impl="recurrent")          # kernels: nothing else dispatched while they run
    # Two tokens through the sequence path: the second output is the step's output.
    ref, ref_st = seq(x[:, 5:], SeqInfo.make(jnp.ones((2, 2), bool)),
                      layer(x[:, :5], SeqInfo.make(jnp.ones((2, 5), bool)), _fresh_kda_state(layer, 2))[1])
    assert_close("out", out, ref[:, 1:])
    assert_close("state", st.recurrent, ref_st.recurrent)
    np.testing.assert_array_equal(st.conv, ref_st.conv)
