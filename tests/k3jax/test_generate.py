"""The generate API and the compiled decode loop."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_greedy_matches

import k3jax
from k3jax.sampling import SamplerInputs, sample


@pytest.fixture(scope="module")
def model():
    return k3jax.CausalLM.random(k3jax.tiny_kimi_linear(num_layers=2), seed=11)   # KDA, MLA, dense, MoE


@pytest.fixture(scope="module")
def generator(model):
    return k3jax.Generator(model)


def python_loop(model, prompt, sp: k3jax.SamplingParams, steps):
    """Reference: prefill, then one decode_step per token from Python, same sampler and positions."""
    logits, state = model.prefill(np.array([prompt]), max_len=len(prompt) + steps + 1)
    inputs = SamplerInputs(jnp.array([sp.temperature], jnp.float32), jnp.array([sp.top_k], jnp.int32),
                           jnp.array([sp.top_p], jnp.float32), jnp.array([sp.row_seed(0)], jnp.uint32),
                           jnp.ones(1), jnp.zeros(1), jnp.zeros(1))
    out = []
    for i in range(steps):
        tok = int(sample(logits, inputs, jnp.array([len(prompt) + i]), filters=sp.filters)[0])
        out.append(tok)
        if tok in sp.stop_token_ids:
            break
        logits, state = model.decode_step(state, [tok])
    return out


@pytest.mark.parametrize("sp", [k3jax.SamplingParams(max_new_tokens=12),
                                k3jax.SamplingParams(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.8, seed=4)])
def test_compiled_loop_equals_python_steps(generator, model, rng, sp):
    prompt = rng.integers(3, 512, 9).tolist()
    out = generator.generate(prompt, sp)
    assert out[0].token_ids == python_loop(model, prompt, sp, sp.max_new_tokens)
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 12


def test_batch_equals_rows_alone(generator, rng):
    prompts = [rng.integers(3, 512, n).tolist() for n in (5, 13, 8)]
    params = [k3jax.SamplingParams(max_new_tokens=10),
              k3jax.SamplingParams(max_new_tokens=7, temperature=1.0, seed=1),
              k3jax.SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.5, seed=2)]
    batch = generator.generate(prompts, params)
    assert batch.buckets["rows"] == 4  # three prompts in a four-row bucket
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone = generator.generate(p, sp)
        assert batch[i].token_ids == alone[0].token_ids, f"row {i}"
    assert [len(r.token_ids) for r in batch] == [10, 7, 10]


def test_no_recompilation_within_a_bucket(generator, model, rng):
    sp = k3jax.SamplingParams(max_new_tokens=9)
    generator.generate([rng.integers(3, 512, 6).tolist(), rng.integers(3, 512, 11).tolist()], sp)
    compiled = lambda: (model.steps.prefill._cache_size(), model.steps.prefill_donated._cache_size(),
                        generator.compiled_chunk._cache_size())
    sizes = compiled()
    assert sizes[1] > 0  # generate's prefill is the donating one (its state is its own)
    out = generator.generate([rng.integers(3, 512, 14).tolist(), rng.integers(3, 512, 3).tolist()],
                             k3jax.SamplingParams(max_new_tokens=13, seed=9))
    assert compiled() == sizes
    assert out.buckets == {"rows": 2, "prompt": 16, "steps": 16}


def test_stop_tokens_and_eos(generator, model, rng):
    prompt = rng.integers(3, 512, 7).tolist()
    free = generator.generate(prompt, k3jax.SamplingParams(max_new_tokens=12))[0].token_ids
    stop = free[4]
    first = free.index(stop)
    out = generator.generate(prompt, k3jax.SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))[0]
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"
    eos_model = model.with_config(dataclasses.replace(model.config, eos_token_id=(stop,)))
    out = k3jax.Generator(eos_model).generate(prompt, k3jax.SamplingParams(max_new_tokens=12))[0]
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"
    ignored = k3jax.Generator(eos_model).generate(prompt, k3jax.SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert ignored[0].token_ids == free


def test_seeds(generator, rng):
    prompt = rng.integers(3, 512, 6).tolist()
    run = lambda seed: generator.generate(prompt, k3jax.SamplingParams(max_new_tokens=16, temperature=1.0,
                                                                         seed=seed))[0].token_ids
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_streaming_chunks_add_up(rng):
    model = k3jax.load_model("tiny-kimi-linear")
    chunks = []
    out = k3jax.generate(model, ["Hello, world!", "你好"], k3jax.SamplingParams(max_new_tokens=20, ignore_eos=True),
                         stream=chunks.append, stream_every=8)
    for i in range(2):
        mine = [c for c in chunks if c.index == i]
        assert len([c for c in mine if c.token_ids]) == 3  # steps 8, 16 and the end (+ a UTF-8 tail flush)
        assert sum((c.token_ids for c in mine), []) == out[i].token_ids
        assert "".join(c.text for c in mine) == out[i].text


@pytest.mark.parametrize("unroll,inner", [("2", "unrolled"), ("4", "loop")])
def test_unrolled_loop_equals_one_step_per_iteration(model, generator, rng, unroll, inner):
    """Several steps per loop iteration (copies of the step, or an inner loop of a known trip count):
    the same tokens, counts, finish reasons and log-probabilities,
    with limits that are not multiples of the unroll, rows that stop early on a stop id, chunks
    (stream_every=7) that end inside an iteration's worth of steps (whole iterations, then the rest
    one step at a time), and penalties."""
    prompts = [rng.integers(3, 512, n).tolist() for n in (5, 13, 8)]
    free = generator.generate(prompts[0], k3jax.SamplingParams(max_new_tokens=12))[0].token_ids
    params = [k3jax.SamplingParams(max_new_tokens=11, stop_token_ids=(free[5],), logprobs=2),
              k3jax.SamplingParams(max_new_tokens=7, temperature=1.0, seed=1, logprobs=2),
              k3jax.SamplingParams(max_new_tokens=13, temperature=0.7, top_p=0.5, seed=2, presence_penalty=0.5,
                                   logprobs=2)]
    unrolled = k3jax.Generator(model.with_impls(loop_unroll=unroll, loop_inner=inner))
    one_step = k3jax.Generator(model.with_impls(loop_unroll="1"))
    for stream_every in (None, 7):
        kw = {} if stream_every is None else {"stream": lambda chunk: None, "stream_every": stream_every}
        want = one_step.generate(prompts, params, **kw)
        got = unrolled.generate(prompts, params, **kw)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids
            assert g.finish_reason == w.finish_reason
            assert g.outputs[0].logprobs == w.outputs[0].logprobs
    assert want[0].finish_reason == "stop" and len(want[0].token_ids) == free.index(free[5]) + 1


def test_first_token_read_after_the_first_chunk_returned(model, rng, monkeypatch):
    """With loop_start="overlap" the helper thread that reads the first token back may run only after the
    first chunk has returned (a busy host): it still reads the prefill's view, not the chunk's. The helper
    is made to start only when its result is asked for."""
    generate_module = sys.modules["k3jax.generate"]
    background = generate_module._Background

    class Late:
        def __init__(self, fn):
            self._fn = fn

        def result(self):
            return background(self._fn).result()

    monkeypatch.setattr(generate_module, "_Background", Late)
    prompts = [rng.integers(3, 512, n).tolist() for n in (5, 13, 8)]
    params = [k3jax.SamplingParams(max_new_tokens=10), k3jax.SamplingParams(max_new_tokens=7, temperature=1.0, seed=1),
              k3jax.SamplingParams(max_new_tokens=4)]
    want = k3jax.Generator(model.with_impls(loop_start="serial")).generate(prompts, params)
    got = k3jax.Generator(model.with_impls(loop_start="overlap")).generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [len(g.token_ids) for g in got] == [10, 7, 4]


def test_overlapped_first_chunk_equals_serial(model, rng, monkeypatch):
    """loop_start="overlap" (the first chunk dispatched while a helper thread reads the first token
    back) against "serial": the same tokens, counts, finish reasons and log-probabilities, with rows of
    different limits, a stop id, sampling and penalties; a batch whose only row ends with its first
    token; max_tokens=2. The read really overlaps the chunk: the helper's read is held until the chunk
    has been called (a serial order would time out). A streamed call keeps the serial order; an error
    in the chunk reaches the caller."""
    import threading

    generate_module = sys.modules["k3jax.generate"]
    prompts = [rng.integers(3, 512, n).tolist() for n in (5, 13, 8)]
    serial = k3jax.Generator(model.with_impls(loop_start="serial"))
    overlap = k3jax.Generator(model.with_impls(loop_start="overlap"))
    free = serial.generate(prompts[0], k3jax.SamplingParams(max_new_tokens=12))[0].token_ids
    chunk, log, dispatched = overlap.compiled_chunk, [], threading.Event()
    read = generate_module.read_host_view

    def spy(*args, **kwargs):
        log.append(("chunk", threading.current_thread().name))
        dispatched.set()
        return chunk(*args, **kwargs)

    def held_read(view, placement):
        if threading.current_thread().name == "k3jax-first-token":
            assert dispatched.wait(60), "the first token was read before the first chunk was called"
            log.append(("first read", threading.current_thread().name))
        return read(view, placement)

    overlap.compiled_chunk = spy
    monkeypatch.setattr(generate_module, "read_host_view", held_read)
    cases = [
        ([k3jax.SamplingParams(max_new_tokens=11, stop_token_ids=(free[5],), logprobs=2),
          k3jax.SamplingParams(max_new_tokens=40, temperature=1.0, seed=1, logprobs=2),
          k3jax.SamplingParams(max_new_tokens=13, temperature=0.7, top_p=0.5, seed=2, presence_penalty=0.5)], 2),
        ([k3jax.SamplingParams(max_new_tokens=9, stop_token_ids=(free[0],))] * 3, 1),   # row 0 ends at once
        ([k3jax.SamplingParams(max_new_tokens=2, ignore_eos=True)] * 3, 1),
    ]
    for params, chunks in cases:
        log.clear()
        dispatched.clear()
        want = serial.generate(prompts, params)
        got = overlap.generate(prompts, params)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids
            assert g.finish_reason == w.finish_reason
            assert g.outputs[0].logprobs == w.outputs[0].logprobs
        assert log[:2] == [("chunk", "MainThread"), ("first read", "k3jax-first-token")], log
        assert [entry for entry in log if entry[0] == "chunk"] == [("chunk", "MainThread")] * chunks, log
    assert len(want[0].token_ids) == 2
    log.clear()
    dispatched.clear()
    only = overlap.generate(prompts[0], k3jax.SamplingParams(max_new_tokens=9, stop_token_ids=(free[0],)))[0]
    assert only.token_ids == [free[0]] and only.finish_reason == "stop" and len(log) == 2
    log.clear()
    streamed = overlap.generate(prompts[:1], k3jax.SamplingParams(max_new_tokens=5, ignore_eos=True),
                                stream=lambda chunk: None, stream_every=2)
    assert len(streamed[0].token_ids) == 5 and log == [("chunk", "MainThread")] * 3   # chunks end at steps 2, 4, 5

    def failing(*args, **kwargs):
        raise RuntimeError("chunk failed")

    overlap.compiled_chunk = failing
    with pytest.raises(RuntimeError, match="chunk failed"):
        overlap.generate(prompts[0], k3jax.SamplingParams(max_new_tokens=6))


@pytest.mark.parametrize("unroll", ["1", "4"])
def test_no_model_step_past_the_last_token(model, rng, unroll):
    """generate samples the first token with the prefill and steps the model once per further token:
    n new tokens cost n - 1 decode steps (the state's consumed-token count says how many ran), also
    with 4 steps per loop iteration (one iteration of 4, then the last step alone)."""
    gen = k3jax.Generator(model.with_impls(loop_unroll=unroll))
    chunk, lengths = gen.compiled_chunk, []

    def spy(*args, **kwargs):
        carry, view = chunk(*args, **kwargs)
        lengths.append(np.asarray(carry.state.lengths))
        return carry, view

    gen.compiled_chunk = spy
    prompt = rng.integers(3, 512, 7).tolist()
    one = gen.generate(prompt, k3jax.SamplingParams(max_new_tokens=1, ignore_eos=True))[0].token_ids
    assert len(one) == 1 and lengths == []           # one token: the prefill's, no decode chunk at all
    six = gen.generate(prompt, k3jax.SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    assert len(six) == 6 and six[0] == one[0]
    width = 16                                      # the prompt's length bucket (left padding)
    ids = np.array([[0] * (width - len(prompt)) + prompt], np.int32)
    _, state = model.prefill(ids, (ids > 0).astype(np.int32) | (np.arange(width) >= width - len(prompt)),
                             max_len=width + 16)
    prefilled = int(np.asarray(state.lengths)[0])
    assert [int(x[0]) for x in lengths] == [prefilled + 5]   # 6 tokens: 5 model steps


def test_loop_steps_choice():
    from k3jax.decode_loop import loop_steps
    assert loop_steps("2", 64) == 2 and loop_steps("1", 1) == 1
    assert loop_steps("auto", 1) == (4 if jax.default_backend() == "gpu" else 1) and loop_steps("auto", 64) == 1
    with pytest.raises(k3jax.errors.ConfigError, match="loop_unroll"):
        k3jax.tiny_kimi_linear().with_impls(loop_unroll="3")


def test_greedy_matches_hf_generate(oracle_dir):
    ref = np.load(oracle_dir / "hf" / "kl_alt" / "reference.npz")
    model = k3jax.load(oracle_dir / "hf" / "kl_alt")
    prompts = ref["input_ids"][:, :int(ref["prompt_len"])].tolist()
    n = ref["greedy_tokens"].shape[1]
    out = k3jax.generate(model, prompts, k3jax.SamplingParams(max_new_tokens=n, ignore_eos=True))
    assert_greedy_matches(np.array([r.token_ids for r in out]), ref["greedy_tokens"], ref["greedy_logits"])


def test_bad_input(generator, model):
    with pytest.raises(ValueError, match="no prompts given"):
        generator.generate([], k3jax.SamplingParams())
    with pytest.raises(ValueError, match="empty prompt"):
        generator.generate([[1, 2], []])
    for ids, bad in (([1, 2, 9999], 9999), ([1, 2**63], 2**63), ([3, -1], -1),
                     (np.array([1, 2**64 - 1], np.uint64), 2**64 - 1)):
        with pytest.raises(ValueError, match=f"token id {bad} outside the vocabulary"):
            generator.generate([ids])
    for ids in ([1, True], [1, 2.0], [[1, 2]]):
        with pytest.raises(ValueError, match="flat list of integers"):
            generator.generate([ids])
    with pytest.raises(ValueError, match="need a tokenizer"):
        generator.generate("text without a tokenizer")
    short = k3jax.Generator(model.with_config(dataclasses.replace(model.config, max_position_embeddings=32)))
    with pytest.raises(ValueError, match="exceeds the context limit 32"):
        short.generate(list(range(3, 30)), k3jax.SamplingParams(max_new_tokens=8))
    for bad in (dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(top_p=0.0), dict(top_p=1.5),
                dict(temperature=-1.0), dict(top_k=-2)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            k3jax.SamplingParams(**bad)
    with pytest.raises(ValueError, match="unknown model 'tiny-gpt'"):
        k3jax.load_model("tiny-gpt")
