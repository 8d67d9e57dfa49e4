"""Sampling as vLLM users know it: max_tokens, n, seed=None, stop strings, logprobs, penalties,
results with outputs[i], defaults from generation_config.json."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from tolerances import assert_close

import k3jax
from k3jax.stop_strings import decode_text

PROMPT = "Hello, world!"


@pytest.fixture(scope="module")
def model():
    # The whole built-in model: its text repeats tokens, so the penalties below change it (a
    # two-layer slice's greedy text has no repeats for them to act on).
    return k3jax.load_model("tiny-kimi-linear")


@pytest.fixture(scope="module")
def gen(model):
    return k3jax.Generator(model)


def test_max_tokens_and_its_alias():
    assert k3jax.SamplingParams(max_tokens=7).max_new_tokens == 7
    assert k3jax.SamplingParams(max_new_tokens=7).max_tokens == 7
    assert k3jax.SamplingParams().max_tokens == 64
    with pytest.raises(ValueError, match="differ"):
        k3jax.SamplingParams(max_tokens=7, max_new_tokens=8)


def test_n_completions_with_seeds(gen):
    sp = k3jax.SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=11, ignore_eos=True)
    out = gen.generate([PROMPT], sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.token_ids == out.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    for c in out.outputs:  # completion c of seed s is the single completion of seed s + c
        alone = gen.generate([PROMPT], k3jax.SamplingParams(max_tokens=10, temperature=1.0, seed=11 + c.index,
                                                            ignore_eos=True))[0]
        assert alone.token_ids == c.token_ids


def test_seed_none_draws_fresh_randomness(gen):
    sp = k3jax.SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    assert sp.seed is None
    assert gen.generate([PROMPT], sp)[0].token_ids != gen.generate([PROMPT], sp)[0].token_ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_text_and_tokens_exactly(gen, model, include):
    free = gen.generate([PROMPT], k3jax.SamplingParams(max_tokens=40, ignore_eos=True))[0]
    tok = model.tokenizer
    # A stop string spanning two tokens: the last character of one token's text and the first of the next.
    for j in range(3, len(free.token_ids) - 1):
        a, b = decode_text(tok, free.token_ids[:j], True), decode_text(tok, free.token_ids[:j + 1], True)
        if len(b) > len(a) > 0 and "\ufffd" not in a[-1] + b[len(a)]:
            stop = a[-1] + b[len(a)]
            if free.text.find(stop) == len(a) - 1:  # not seen earlier in the text
                break
    else:
        pytest.fail("no clean token boundary in the free text; pick another prompt")
    cut = free.text.find(stop)
    out = gen.generate([PROMPT], k3jax.SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop, "\x00never"],
                                                      include_stop_str_in_output=include))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == free.text[:cut + (len(stop) if include else 0)]
    kept = out.token_ids
    assert kept == free.token_ids[:len(kept)]
    assert stop in decode_text(tok, kept, True) and stop not in decode_text(tok, kept[:-1], True)
    chunks = []
    streamed = gen.generate([PROMPT], k3jax.SamplingParams(max_tokens=40, ignore_eos=True, stop=stop,
                                                           include_stop_str_in_output=include),
                            stream=chunks.append, stream_every=3)[0]
    assert "".join(c.text for c in chunks) == streamed.text == out.text
    assert sum((c.token_ids for c in chunks), []) == streamed.token_ids


def test_stop_string_in_the_only_token(gen):
    """max_tokens=1 runs no decode chunk (the token comes with the prefill); a stop string inside that
    token still ends the text there, streamed or not."""
    free = gen.generate([PROMPT], k3jax.SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert len(free.token_ids) == 1 and free.text.strip()
    stop = free.text.strip()[-1]
    for kw in ({}, {"stream": lambda chunk: None, "stream_every": 2}):
        out = gen.generate([PROMPT], k3jax.SamplingParams(max_tokens=1, ignore_eos=True, stop=[stop]), **kw)[0]
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert out.text == free.text[:free.text.rfind(stop)]


def _reference_steps(model, prompt, steps, penalties=(1.0, 0.0, 0.0)):
    """Greedy with penalties and raw log-probabilities, one Python step at a time (numpy formulas)."""
    rep, pres, freq = penalties
    ids = model.tokenizer.encode(prompt)
    logits, state = model.prefill(np.array([ids]), max_len=len(ids) + steps + 1)
    counts = np.zeros(model.config.vocab_size)
    seen = np.zeros(model.config.vocab_size, bool)
    seen[ids] = True
    out, logprobs = [], []
    for _ in range(steps):
        raw = np.asarray(logits[0], np.float64)
        pen = np.where(seen, np.where(raw > 0, raw / rep, raw * rep), raw) - freq * counts - pres * (counts > 0)
        t = int(np.argmax(pen))
        logp = raw - raw.max() - np.log(np.sum(np.exp(raw - raw.max())))
        out.append(t)
        logprobs.append(logp)
        counts[t] += 1
        seen[t] = True
        logits, state = model.decode_step(state, [t])
    return out, np.array(logprobs)


def test_logprobs_of_greedy_decoding(gen, model):
    out = gen.generate([PROMPT], k3jax.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))[0].outputs[0]
    ref_tokens, ref_logp = _reference_steps(model, PROMPT, 6)
    assert out.token_ids == ref_tokens and len(out.logprobs) == 6
    for t, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert len(entry) == 3 and tok in entry        # greedy: the sampled token is among the top 3
        top = np.argsort(-ref_logp[t])[:3]
        assert set(entry) == set(top.tolist())
        assert_close(f"step {t}", np.array([entry[i] for i in top]), ref_logp[t][top], dtype="float32")
    assert_close("cumulative", out.cumulative_logprob, sum(e[t] for e, t in zip(out.logprobs, out.token_ids)),
                 dtype="float32")


def test_penalties_match_their_formulas(gen, model):
    penalties = (1.8, 0.6, 0.9)
    sp = k3jax.SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=penalties[0],
                              presence_penalty=penalties[1], frequency_penalty=penalties[2])
    ours = gen.generate([PROMPT], sp)[0].token_ids
    ref, _ = _reference_steps(model, PROMPT, 12, penalties)
    assert ours == ref
    plain = gen.generate([PROMPT], k3jax.SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    assert ours != plain  # the penalties change the text of this model
    mixed = gen.generate([PROMPT, PROMPT], [sp, k3jax.SamplingParams(max_tokens=12, ignore_eos=True)])
    assert [r.token_ids for r in mixed] == [ours, plain]  # rows without penalties are untouched


def test_generation_config_gives_the_defaults(tmp_path, oracle_dir):
    src = oracle_dir / "hf" / "kl_alt"
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 5, "eos_token_id": 2}))
    model = k3jax.load(tmp_path)
    assert model.generation_config["temperature"] == 0.6
    sp = k3jax.Generator(model).default_sampling()
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.6, 0.9, 5)
    out = k3jax.Generator(model).generate([[5, 6, 7]])
    assert len(out[0].token_ids) <= 5
    assert k3jax.SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.7}).temperature == 0.0


def test_fresh_and_row_order_independence(gen):
    """A row's result does not depend on its neighbours, also with stop strings and logprobs."""
    sps = [k3jax.SamplingParams(max_tokens=9, temperature=0.8, seed=5, logprobs=1),
           k3jax.SamplingParams(max_tokens=9, stop=["e"], ignore_eos=True)]
    both = gen.generate([PROMPT, "Hi"], sps)
    for i, (p, sp) in enumerate(zip([PROMPT, "Hi"], sps)):
        assert gen.generate([p], sp)[0].token_ids == both[i].token_ids
    jax.effects_barrier()
