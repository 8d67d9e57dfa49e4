"""The K3 model end to end on a 13-layer tiny config: prefill + decode == longer prefill with every
implementation, and left padding."""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import assert_close

import k3jax
from k3jax.config import tiny_k3


@pytest.fixture(scope="module")
def k3_model():
    cfg = tiny_k3()
    assert cfg.num_layers == 13 and cfg.attn_res.block_size == 3 and cfg.mixers[-1] == "mla"
    assert cfg.attn_res.num_blocks(13) == 5  # boundaries at layers 0, 3, 6, 9, 12
    return k3jax.CausalLM.random(cfg, seed=5)



@pytest.mark.parametrize("impls", [{}, {"kda": "pallas", "kda_decode": "pallas", "mla": "pallas"}])
def test_k3_prefill_decode_equals_longer_prefill(k3_model, rng, impls):
    k3_model = k3_model.with_impls(**impls)
    ids = rng.integers(0, 512, (2, 24))
    full = np.asarray(k3_model.logits(ids))
    logits, state = k3_model.prefill(ids[:, :19])
    assert_close("prefill", logits, full[:, 18])
    for t in range(19, 24):
        logits, state = k3_model.decode_step(state, ids[:, t])
        assert_close(f"step {t}", logits, full[:, t])



def test_k3_left_padded_row_equals_alone(k3_model, rng):
    # The batch has the [2, 19] shape of the prefill above: its compiled programs serve here too.
    row = rng.integers(0, 512, 16)
    ids = np.stack([rng.integers(0, 512, 19), np.concatenate([[5, 6, 7], row])])
    mask = np.array([[1] * 19, [0, 0, 0] + [1] * 16])
    logits, state = k3_model.prefill(ids, mask)
    alone, alone_state = k3_model.prefill(row[None])
    assert_close("prefill", logits[1], alone[0])
    logits, _ = k3_model.decode_step(state, np.array([9, 11]))
    alone, _ = k3_model.decode_step(alone_state, np.array([11]))
    assert_close("step", logits[1], alone[0])

