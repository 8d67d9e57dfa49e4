"""MLA attention: absorbed == naive == numpy, and every latent-cache implementation agrees."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

from k3jax.layers.mla_attention import MLA_DECODE_IMPLS, attention_absorbed, attention_naive, cache_attention


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



@pytest.mark.parametrize("impl", MLA_DECODE_IMPLS)
def test_cache_attention_implementations_agree(rng, impl):
    """Two query tokens per row over a 64-slot cache at ragged lengths, slots past them poisoned."""
    b, t, s, h, n, p, r, v = 2, 2, 64, 4, 16, 16, 32, 16
    q_nope = jnp.asarray(rng.standard_normal((b, t, h, n)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((b, t, h, p)), jnp.float32)
    last = np.array([[20, 21], [40, 41]], np.int32)
    cache = rng.standard_normal((b, s, r + p)).astype(np.float32)
    clean = jnp.asarray(np.where(np.arange(s)[None, :, None] <= last[:, -1:, None], cache, 0.0))
    poisoned = jnp.asarray(np.where(np.arange(s)[None, :, None] <= last[:, -1:, None], cache, np.nan))
    w_kv_b = jnp.asarray(rng.standard_normal((r, h * (n + v))) / np.sqrt(r), jnp.float32)
    kw = dict(scale=(n + p) ** -0.5, v_dim=v)
    ref = cache_attention("naive", q_nope, q_pe, clean, w_kv_b, jnp.asarray(last), **kw)
    out = cache_attention(impl, q_nope, q_pe, poisoned if impl == "pallas" else clean, w_kv_b, jnp.asarray(last),
                          **kw)
    assert_close(impl, out, ref)
