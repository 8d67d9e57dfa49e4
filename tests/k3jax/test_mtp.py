"""MTP draft layer: the input formula, the position-0 mask, and the layer against its parts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

import k3jax
from k3jax.config import tiny_k3
from k3jax.state import SeqInfo


@pytest.fixture(scope="module")
def k3_model():
    return k3jax.CausalLM.random(tiny_k3(num_layers=5, attn_res_block_size=2), seed=5)


def test_mtp_formula_and_position_zero_mask(k3_model, rng):
    ids = rng.integers(0, 512, (2, 8))
    hidden = k3_model.hidden_states(ids)
    assert_close("hidden -> logits", k3_model.module.logits(hidden), k3_model.logits(ids))
    nxt = rng.integers(0, 512, (2, 8))
    h_mtp, logits = k3_model.mtp(hidden, nxt)
    # The layer input by hand: [enorm(embed), hnorm(hidden)] (embedding half first, zero at position 0).
    mtp = k3_model.module.mtp[0]
    emb = np.asarray(k3_model.params["model"]["embed_tokens"]["embedding"][...])[nxt]
    emb[:, 0] = 0
    rms = lambda x, w: w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-5)
    u = np.concatenate([rms(emb, np.asarray(mtp.enorm.weight[...])), rms(np.asarray(hidden), np.asarray(mtp.hnorm.weight[...]))], -1)
    x = u @ np.asarray(mtp.eh_proj.kernel[...])
    y, _ = mtp(jnp.asarray(x, jnp.float32), SeqInfo.make(jnp.ones((2, 8), bool)), None, fresh=True)
    assert_close("mtp hidden", h_mtp, y)
    assert_close("mtp logits", logits, mtp.shared_head(y))
    # Position 0's token is masked out entirely.
    changed = nxt.copy()
    changed[:, 0] = (changed[:, 0] + 1) % 512
    assert_close("position-0 token ignored", k3_model.mtp(hidden, changed)[1], logits, tol=0.0)
    # At a later start position the first token does count.
    pos = np.broadcast_to(np.arange(5, 13), (2, 8))
    assert np.abs(np.asarray(k3_model.mtp(hidden, changed, positions=pos)[1])
                  - np.asarray(k3_model.mtp(hidden, nxt, positions=pos)[1])).max() > 1e-5

