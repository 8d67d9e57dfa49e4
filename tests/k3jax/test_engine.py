"""The continuous-batching engine: results equal static generation whatever the batching, slots
are reused without recompiling, requests are checked on the way in."""

from __future__ import annotations

import numpy as np
import pytest
from checkpoints import builtin_model

import k3jax
from k3jax.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def model():
    return builtin_model("tiny-kimi-linear", 2)     # KDA and MLA, dense and MoE


def run_all(engine: Engine) -> dict:
    results, streamed = {}, {}
    while engine.has_work():
        for update in engine.step():
            for c, toks in update.new_tokens.items():
                streamed.setdefault((update.request_id, c), []).extend(toks)
            if update.result is not None:
                results[update.request_id] = update.result
    return results, streamed


@pytest.mark.parametrize("unroll,chunk_steps", [("1", 5), ("2", 5)])   # 2 steps per iteration, then the rest
def test_results_equal_static_generation(model, unroll, chunk_steps):
    """(Two decode steps per loop iteration in the second case, against the one-step static loop.)"""
    rng = np.random.default_rng(0)
    requests = []
    for i in range(11):  # more requests than slots: admission happens while others decode
        prompt = rng.integers(3, 500, int(rng.integers(2, 30))).tolist()
        kind = i % 4
        if kind == 0:
            sp = k3jax.SamplingParams(max_tokens=int(rng.integers(3, 30)), ignore_eos=True)
        elif kind == 1:
            sp = k3jax.SamplingParams(max_tokens=int(rng.integers(3, 30)), temperature=0.9, top_p=0.8, seed=i)
        elif kind == 2:
            sp = k3jax.SamplingParams(max_tokens=20, temperature=1.0, seed=100 + i, n=2, ignore_eos=True)
        else:
            sp = k3jax.SamplingParams(max_tokens=25, ignore_eos=True, stop=["e"])
        requests.append((f"r{i}", prompt, sp))
    engine = Engine(model.with_impls(loop_unroll=unroll), EngineConfig(max_slots=4, max_len=128,
                                                                        chunk_steps=chunk_steps))
    assert engine._unroll == int(unroll)
    for rid, prompt, sp in requests:
        engine.add(rid, prompt, sp)
    results, streamed = run_all(engine)
    # Static generation of all the requests in one batch of rows (rows do not interact).
    refs = k3jax.Generator(model).generate([prompt for _, prompt, _ in requests], [sp for _, _, sp in requests])
    for (rid, prompt, sp), ref in zip(requests, refs, strict=True):
        got = results[rid]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs], rid
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in ref.outputs], rid
        assert [c.text for c in got.outputs] == [c.text for c in ref.outputs], rid
        for c in got.outputs:
            assert streamed[(rid, c.index)] == c.token_ids  # the streamed deltas add up
    assert not engine.has_work() and engine.num_running == 0


def test_slots_are_reused_without_recompiling(model):
    engine = Engine(model, EngineConfig(max_slots=2, max_len=64, chunk_steps=4))
    sp = k3jax.SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add("warm-a", [5, 6, 7], sp)     # admissions of one and of two prompts (the two sizes here)
    run_all(engine)
    engine.add("warm-b", [8, 9], sp)
    engine.add("warm-c", [8, 9, 10, 11], sp)
    run_all(engine)
    compiled = lambda: (engine._chunk._cache_size(), engine._insert._cache_size(), model.steps.prefill._cache_size(),
                        model.steps.prefill_donated._cache_size())
    sizes = compiled()
    assert sizes[3] > 0  # admissions prefill through the donating step (the state is the engine's own)
    for i in range(5):
        engine.add(f"x{i}", [10 + i, 11, 12][: 1 + i % 3], k3jax.SamplingParams(max_tokens=3 + i, ignore_eos=True))
    results, _ = run_all(engine)
    assert len(results) == 5 and [len(results[f"x{i}"].token_ids) for i in range(5)] == [3, 4, 5, 6, 7]
    assert compiled() == sizes


def test_a_prompt_whose_bucket_exceeds_max_len(model):
    """max_len 100 is no prompt bucket: a 70-token prompt is prefilled at width 100, not 128."""
    engine = Engine(model, EngineConfig(max_slots=2, max_len=100, chunk_steps=4))
    prompt, sp = list(range(5, 75)), k3jax.SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add("a", prompt, sp)
    results, _ = run_all(engine)
    assert results["a"].token_ids == k3jax.Generator(model).generate([prompt], sp)[0].token_ids


def test_bad_requests_are_refused_on_the_way_in(model):
    engine = Engine(model, EngineConfig(max_slots=2, max_len=32))
    engine.add("a", [5, 6], k3jax.SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add("a", [5, 6])
    with pytest.raises(ValueError, match="exceeds the engine's max_len 32"):
        engine.add("b", list(range(3, 30)), k3jax.SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="penalties need"):
        engine.add("c", [5], k3jax.SamplingParams(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="logprobs=1 exceeds"):
        engine.add("d", [5], k3jax.SamplingParams(logprobs=1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add("e", [5, 10 ** 6])
    with pytest.raises(ValueError, match="n=3 exceeds"):
        engine.add("f", [5], k3jax.SamplingParams(n=3, max_tokens=4))


def test_abort_frees_the_slots(model):
    engine = Engine(model, EngineConfig(max_slots=2, max_len=64, chunk_steps=2))
    engine.add("long", [5, 6, 7], k3jax.SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add("queued", [5, 6], k3jax.SamplingParams(max_tokens=3, ignore_eos=True, n=2))
    engine.step()
    partial = engine.abort("long")
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 40
    assert engine.abort("nobody") is None
    results, _ = run_all(engine)
    assert list(results) == ["queued"] and len(results["queued"].outputs) == 2


def test_penalties_and_logprobs_in_the_engine(model):
    sp = k3jax.SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.7, frequency_penalty=0.5,
                              logprobs=2)
    engine = Engine(model, EngineConfig(max_slots=2, max_len=64, chunk_steps=3, penalties=True, max_logprobs=2))
    engine.add("p", [5, 6, 7], sp)
    engine.add("q", [8, 9], k3jax.SamplingParams(max_tokens=5, ignore_eos=True))
    results, _ = run_all(engine)
    ref = k3jax.Generator(model).generate([[5, 6, 7]], sp)[0].outputs[0]
    got = results["p"].outputs[0]
    assert got.token_ids == ref.token_ids
    assert [sorted(e) for e in got.logprobs] == [sorted(e) for e in ref.logprobs]
    np.testing.assert_allclose(got.cumulative_logprob, ref.cumulative_logprob, rtol=1e-5)
