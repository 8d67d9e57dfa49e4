"""Independent formulations of the same computation on a tiny random model:
prefill + decode == longer prefill, left-padded batch == rows alone, chunked continuation, a
chunked prefill == one call."""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import assert_close

import k3jax
from k3jax.memory_plan import MIN_PREFILL_CHUNK, prefill_chunk_length
from k3jax.config import tiny_k3, tiny_kimi_linear
from k3jax.layers import mla_attention

CONFIG = tiny_kimi_linear(num_layers=2)     # a KDA then an MLA layer, a dense then an MoE FFN


@pytest.fixture(scope="module")
def model():
    return k3jax.CausalLM.random(CONFIG, seed=3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_then_decode_equals_longer_prefill(model, dtype, rng):
    if dtype != "float32":
        model = k3jax.CausalLM.random(CONFIG, seed=3, dtype=dtype)
    ids = rng.integers(0, model.config.vocab_size, (2, 29))
    full = np.asarray(model.logits(ids))
    logits, state = model.prefill(ids[:, :21])
    assert_close("prefill", logits, full[:, 20], dtype=model.dtype)
    for t in range(21, 29):
        logits, state = model.decode_step(state, ids[:, t])
        assert_close(f"step {t}", logits, full[:, t], dtype=model.dtype)
    np.testing.assert_array_equal(state.lengths, [29, 29])
    # The state after prefill(21) + 8 steps equals the state of one prefill(29).
    _, direct = model.prefill(ids, max_len=state.capacity)
    for i, (a, b) in enumerate(zip(state.layers, direct.layers)):
        for name in a.__dataclass_fields__:
            assert_close(f"layer {i} {name}", getattr(a, name), getattr(b, name), dtype=model.dtype)


def test_left_padded_batch_equals_rows_alone(model, rng):
    lengths = [9, 14, 9]
    rows = [rng.integers(0, model.config.vocab_size, n) for n in lengths]
    width = max(lengths)
    ids = np.zeros((3, width), np.int32)
    mask = np.zeros((3, width), np.int32)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        ids[i, :width - len(r)] = rng.integers(0, model.config.vocab_size, width - len(r))  # garbage padding
        mask[i, width - len(r):] = 1
    steps = rng.integers(0, model.config.vocab_size, (3, 4))
    logits, state = model.prefill(ids, mask)
    batch = [np.asarray(logits)]
    for s in range(steps.shape[1]):
        logits, state = model.decode_step(state, steps[:, s])
        batch.append(np.asarray(logits))
    np.testing.assert_array_equal(state.lengths, np.array(lengths) + steps.shape[1])
    for i, r in enumerate(rows):
        logits, st = model.prefill(r[None])
        alone = [np.asarray(logits)]
        for s in range(steps.shape[1]):
            logits, st = model.decode_step(st, steps[i:i + 1, s])
            alone.append(np.asarray(logits))
        assert_close(f"row {i}", np.stack([b[i] for b in batch]), np.concatenate(alone), dtype=model.dtype)
    full_masked = np.asarray(model.logits(ids, mask))
    assert_close("logits() row 0", full_masked[0, width - lengths[0]:], model.logits(rows[0][None])[0],
                 dtype=model.dtype)


def test_chunked_prefill_continuation_with_uneven_rows(model, rng):
    """Row 0 continues with 6 tokens, row 1 with 3 (left-padded): each equals one long prefill."""
    vocab = model.config.vocab_size
    first = rng.integers(0, vocab, (2, 17))
    more = [rng.integers(0, vocab, 6), rng.integers(0, vocab, 3)]
    _, state = model.prefill(first, max_len=64)
    ids = np.stack([more[0], np.concatenate([[0, 0, 0], more[1]])])
    mask = np.array([[1] * 6, [0, 0, 0, 1, 1, 1]])
    logits, state = model.prefill(ids, mask, state=state)
    np.testing.assert_array_equal(state.lengths, [23, 20])
    for i in range(2):
        alone, _ = model.prefill(np.concatenate([first[i], more[i]])[None])
        assert_close(f"row {i}", logits[i], alone[0], dtype=model.dtype)


def test_prefill_chunk_length():
    assert prefill_chunk_length(1, 8192, 16384) == 8192          # fits one call
    assert prefill_chunk_length(1, 131072, 16384) == 16384
    assert prefill_chunk_length(64, 1024, 16384) == 256
    assert prefill_chunk_length(3, 1000, 1000) == 256            # the largest power of two under 333
    assert prefill_chunk_length(4096, 128, 16384) == MIN_PREFILL_CHUNK  # never below the minimum
    assert prefill_chunk_length(64, 1024, 0) == 1024             # 0: one call


def test_chunked_prefill_equals_one_call(model, rng):
    """A prompt over the per-call budget runs as chunks that continue the state: the logits of every
    position, the state, and the decode steps after it equal one call. Rows of 150, 70 and 5
    tokens (rows 1 and 2 start after the first chunk; the width is not a multiple of it)."""
    lengths = [150, 70, 5]
    width = max(lengths)
    ids = rng.integers(0, model.config.vocab_size, (3, width))
    mask = np.arange(width)[None, :] >= width - np.array(lengths)[:, None]
    ids = np.where(mask, ids, 0)
    one = model.with_config(model.config.replace(prefill_chunk_tokens=0))
    chunked = model.with_config(model.config.replace(prefill_chunk_tokens=3 * 64))  # 64-token chunks, 3 calls
    assert chunked.prefill_calls(3, width) == [(64, True), (64, False), (64, False)]
    ref_logits, ref_state = one.prefill(ids, mask, max_len=192, all_logits=True)
    logits, state = chunked.prefill(ids, mask, max_len=192, all_logits=True)
    assert_close("all logits (real tokens)", np.asarray(logits)[mask], np.asarray(ref_logits)[mask])
    np.testing.assert_array_equal(state.lengths, lengths)
    for i, (a, b) in enumerate(zip(state.layers, ref_state.layers)):
        for name in a.__dataclass_fields__:
            assert_close(f"layer {i} {name}", getattr(a, name), getattr(b, name))
    last, state = chunked.prefill(ids, mask, max_len=192)
    assert_close("last logits", last, np.asarray(ref_logits)[:, -1])
    nxt = rng.integers(0, model.config.vocab_size, 3)
    assert_close("decode after", chunked.decode_step(state, nxt)[0], one.decode_step(ref_state, nxt)[0])


def test_chunked_prefill_with_the_fused_attention_forms(model, rng, monkeypatch):
    """mla_prefill="cudnn" (a fresh chunk, then chunks over the cache in two merged parts), run through
    jax.nn.dot_product_attention's XLA implementation so the wiring is checked off the GPU: equal to
    one naive call."""
    monkeypatch.setattr(mla_attention, "FUSED_ATTENTION", "xla")
    lengths = [150, 70]
    ids = rng.integers(0, model.config.vocab_size, (2, 150))
    mask = np.arange(150)[None, :] >= 150 - np.array(lengths)[:, None]
    one = model.with_config(model.config.with_impls(mla_prefill="naive").replace(prefill_chunk_tokens=0))
    fused = model.with_config(model.config.with_impls(mla_prefill="cudnn").replace(prefill_chunk_tokens=2 * 64))
    ref, _ = one.prefill(ids, mask, max_len=192, all_logits=True)
    out, _ = fused.prefill(ids, mask, max_len=192, all_logits=True)
    assert_close("fused forms, chunked", np.asarray(out)[mask], np.asarray(ref)[mask])


@pytest.mark.parametrize("family", ["kimi_linear", "k3"])
def test_decode_projections_through_the_kernel_equal_the_dot(model, family, rng):
    """linear="pallas" (the few-row projections of a step fused into few launches of the skinny
    kernel: KDA's q|k|v|f_a|b|g, MLA's q|kv_a|g, the MLPs' gate|up; the top-k router kernel on the
    router's partial sums; the one-launch residual norms) == one XLA dot each, XLA's top-k and norms. Both families: Kimi-Linear's
    low-rank output gate, K3's full-rank gate, q-LoRA, MLA output gate and latent MoE."""
    if family == "k3":
        model = k3jax.CausalLM.random(tiny_k3(num_layers=4, attn_res_block_size=2), seed=5)
    ids = rng.integers(0, model.config.vocab_size, (2, 12))
    outs = []
    for impl in ("xla", "pallas"):
        m = model.with_impls(linear=impl, router=impl, norm="fused" if impl == "pallas" else impl)
        logits, state = m.prefill(ids[:, :10])
        steps = [m.decode_step(state, ids[:, 10])[0]]
        outs.append(np.concatenate([np.asarray(logits), np.asarray(steps[0])]))
    assert_close("decode logits", outs[1], outs[0])
