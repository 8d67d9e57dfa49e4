"""Attention residuals: the mixing formula, and the buffer form against the list reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_close

import k3jax
from k3jax.config import tiny_k3
from k3jax.layers.attn_res import attn_res_mix, attn_res_mix_list


def numpy_attn_res(sources, gamma, w, eps):
    v = np.asarray(sources, np.float64)
    normed = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
    s = np.einsum("s...d,d->s...", normed, gamma * w)
    a = np.exp(s - s.max(0))
    a /= a.sum(0)
    return np.einsum("s...,s...d->...d", a, v)



def test_attn_res_mix_matches_formula(rng):
    d = 32
    sources = rng.standard_normal((4, 2, 5, d)).astype(np.float32) * rng.uniform(0.5, 3, (4, 1, 1, 1))
    gamma = rng.standard_normal(d).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    expected = numpy_attn_res(sources, gamma, w, 1e-5)
    assert_close("list form", attn_res_mix_list(list(sources), gamma, w, 1e-5, jnp.float32), expected)
    # Buffer form: 6 slots, of which slots 1 and 3 hold garbage and are masked out.
    buf = np.concatenate([sources[:1], 1e3 * np.ones_like(sources[:1]), sources[1:2], sources[:1] * 7,
                          sources[2:]], axis=0)
    valid = np.array([True, False, True, False, True, True])
    assert_close("buffer form", attn_res_mix(buf, valid, gamma, w, 1e-5, jnp.float32), expected)



@pytest.fixture(scope="module")
def k3_model():
    cfg = tiny_k3(num_layers=7, attn_res_block_size=3, num_mtp_layers=0)
    assert cfg.attn_res.num_blocks(7) == 3  # boundaries at layers 0, 3, 6
    return k3jax.CausalLM.random(cfg, seed=5)


def test_block_buffer_equals_list_reference(k3_model, rng):
    ids = rng.integers(0, 512, (2, 11))
    listed = k3_model.with_impls(attn_res="list")
    assert_close("buffer vs list", k3_model.logits(ids), listed.logits(ids))
    # AttnRes really mixes: uniform depth weights (zero projection) give different logits.
    flat = [(p, v.replace(jnp.zeros_like(v.get_value())) if p[-2:] == ("proj", "kernel") else v)
            for p, v in nnx.to_flat_state(k3_model.params)]
    uniform = k3jax.CausalLM(nnx.merge(k3_model.graphdef, nnx.from_flat_state(flat)), k3_model.config)
    assert np.abs(np.asarray(uniform.logits(ids)) - np.asarray(k3_model.logits(ids))).max() > 1e-3

