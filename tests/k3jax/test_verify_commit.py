"""A verify window of Q tokens, then a commit of the first `keep` of them, against decoding the
same tokens one by one: logits of every window position, the state after the commit (KDA conv and
recurrent state, MLA latents of the kept slots, lengths) and the next decode step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

import k3jax
from k3jax.config import tiny_k3, tiny_kimi_linear
from k3jax.state import KDAState, MLACache
from k3jax.steps import commit_step, verify_step

Q = 4


@pytest.fixture(scope="module", params=["k3", "kimi_linear"])
def model(request):
    # Every layer kind (KDA and MLA, dense and MoE; K3: AttnRes blocks, MTP) in few layers.
    cfg = tiny_k3(num_layers=4, attn_res_block_size=2) if request.param == "k3" else tiny_kimi_linear(num_layers=2)
    return k3jax.CausalLM.random(cfg, seed=11)


def _copy(state):
    return jax.tree.map(jnp.copy, state)


def _assert_state_equal(name, actual, expected, row):
    assert int(actual.lengths[row]) == int(expected.lengths[row]), f"{name}: lengths"
    used = int(expected.lengths[row])
    for i, (a, e) in enumerate(zip(actual.layers, expected.layers)):
        if isinstance(e, MLACache):
            assert_close(f"{name} layer {i} latents", a.latent[row, :used], e.latent[row, :used])
        else:
            assert isinstance(a, KDAState)
            assert_close(f"{name} layer {i} conv", a.conv[row], e.conv[row])
            assert_close(f"{name} layer {i} recurrent", a.recurrent[row], e.recurrent[row])


@pytest.mark.parametrize("impls", [{}, {"kda_decode": "pallas", "mla": "pallas"}])
def test_verify_then_commit_equals_decoding_the_kept_tokens(model, rng, impls):
    model = model.with_impls(**impls)
    vocab = model.config.vocab_size
    ids = rng.integers(0, vocab, (4, 10))
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    window = rng.integers(0, vocab, (4, Q))
    keep = np.array([0, 1, 3, Q], np.int32)

    _, state = model.prefill(ids, mask, max_len=64)
    start = np.asarray(state.lengths)
    logits, _, pending = jax.jit(lambda p, s, t: verify_step(model.graphdef, p, s, t))(
        model.params, _copy(state), jnp.asarray(window))
    committed = jax.jit(functools.partial(commit_step, model.graphdef))(
        model.params, pending, jnp.asarray(start), jnp.asarray(keep))

    step_state, snapshots, step_logits = state, [_copy(state)], []
    for t in range(Q):
        out, step_state = model.decode_step(step_state, window[:, t])
        step_logits.append(np.asarray(out))
        snapshots.append(_copy(step_state))
    assert_close("window logits", logits, np.stack(step_logits, axis=1))
    for row, kept in enumerate(keep):
        _assert_state_equal(f"row {row} keeping {kept}", committed, snapshots[kept], row)

    # Decoding on from the committed state equals decoding on from the snapshot of each row.
    nxt = rng.integers(0, vocab, (4,))
    after, _ = model.decode_step(committed, nxt)
    for row, kept in enumerate(keep):
        expected, _ = model.decode_step(_copy(snapshots[kept]), nxt)
        assert_close(f"row {row}: next step after keeping {kept}", after[row], expected[row])
