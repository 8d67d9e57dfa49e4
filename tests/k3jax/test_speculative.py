"""Speculative decoding: greedy output identical to plain decoding with every draft source and in
the corner cases (reject at position 0, accept all, a stop token or the length limit inside an
accepted run, rows accepting different counts), the rejection rule's distribution, prompt lookup
and MTP drafts against independent formulations, and the errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

import k3jax
from k3jax import SamplingParams, SpeculativeConfig
from k3jax.config import tiny_k3
from k3jax.sampling import SamplerInputs
from k3jax.speculative.acceptance import verify_tokens
from k3jax.speculative.context import PromptView, VerifyOutcome
from k3jax.speculative.mtp_drafts import MTPDrafts
from k3jax.speculative.ngram import lookup
from k3jax.state import MLACache
from k3jax.synthetic import plant_greedy_chain

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return k3jax.CausalLM.random(tiny_k3(num_layers=4, attn_res_block_size=2), seed=7)


@pytest.fixture(scope="module")
def gen(model):
    return k3jax.Generator(model)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    pattern = list(rng.integers(0, VOCAB, 4))
    return [list(rng.integers(0, VOCAB, 9)), pattern * 3, list(rng.integers(0, VOCAB, 5))]


def _tokens(out):
    return [r.outputs[0].token_ids for r in out.results]


def _finishes(out):
    return [r.outputs[0].finish_reason for r in out.results]


@pytest.fixture(scope="module")
def plain(gen, prompts):
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 13, 17)]
    return params, gen.generate(prompts, params)


@pytest.mark.parametrize("spec", [SpeculativeConfig("ngram", 3), SpeculativeConfig("mtp", 3), None],
                         ids=["ngram", "mtp", "replay"])
def test_greedy_output_equals_plain_decoding(gen, prompts, plain, spec):
    params, expected = plain
    if spec is None:  # half the drafts wrong: rows accept different counts at every step
        spec = SpeculativeConfig("replay", 3, replay_tokens=_tokens(expected), replay_error_rate=0.5)
    out = gen.generate(prompts, params, speculative=spec)
    assert _tokens(out) == _tokens(expected)
    assert _finishes(out) == ["length"] * 3
    stats = out.timings.speculative
    assert stats.method == spec.method and stats.num_draft_tokens == 3 and len(stats.acceptance_rate) == 3
    after_prefill = sum(len(t) for t in _tokens(out)) - len(prompts)  # the first token comes from the prefill
    # Each step emits the drafts it kept and one token of the target's (statistics count only the
    # drafts that reach the output, so a run the length limit cuts counts what it emitted).
    assert after_prefill == stats.steps + stats.accepted
    if spec.method == "replay":
        assert 0 < stats.accepted < 3 * stats.steps


def test_chunked_prefill_before_speculative_decoding(model, prompts, plain):
    """Prompts prefilled in 64-token chunks (a 2-call budget) and then decoded with prompt-lookup
    drafts give the same greedy tokens as one-call prefill and plain decoding."""
    params, expected = plain
    long_prompts = [list(np.random.default_rng(9).integers(0, VOCAB, 120))] + prompts[1:]
    chunked = k3jax.Generator(model.with_config(model.config.replace(prefill_chunk_tokens=3 * 64)))
    assert chunked.model.prefill_calls(4, 128) == [(64, True), (64, False)]
    one = k3jax.Generator(model.with_config(model.config.replace(prefill_chunk_tokens=0)))
    want = _tokens(one.generate(long_prompts, params))
    assert _tokens(chunked.generate(long_prompts, params, speculative=SpeculativeConfig("ngram", 3))) == want
    assert _tokens(chunked.generate(long_prompts, params)) == want


def test_prompt_lookup_drafts_are_accepted_on_a_planted_chain(model):
    """Prompt lookup finds the continuation in the prompt: drafts are accepted, output unchanged."""
    planted, perm = plant_greedy_chain(model, seed=5)
    chain = [17]
    for _ in range(11):
        chain.append(int(perm[chain[-1]]))
    prompt = chain[:10] + chain[:2]          # the text after the last two tokens is in the prompt
    gen = k3jax.Generator(planted)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = gen.generate([prompt], params)
    assert _tokens(plain)[0][:8] == chain[2:10]  # the planted chain is what greedy decoding follows
    out = gen.generate([prompt], params, speculative=SpeculativeConfig("ngram", 3))
    assert _tokens(out) == _tokens(plain)
    stats = out.timings.speculative
    assert stats.accepted >= 6 and stats.acceptance_rate[0] > 0.5, stats


def test_accept_all_with_the_limit_and_a_stop_token_inside_an_accepted_run(gen, prompts, plain):
    _, expected = plain
    recorded = _tokens(expected)
    stop = recorded[0][6]
    params = [SamplingParams(max_tokens=20, stop_token_ids=(stop,), ignore_eos=True),
              SamplingParams(max_tokens=7, ignore_eos=True),      # 1 + 4 + 4 tokens would pass 7
              SamplingParams(max_tokens=17, ignore_eos=True)]
    reference = gen.generate(prompts, params)
    out = gen.generate(prompts, params, speculative=SpeculativeConfig("replay", 3, replay_tokens=recorded))
    assert _tokens(out) == _tokens(reference)
    assert _finishes(out) == _finishes(reference) == ["stop", "length", "length"]
    assert len(_tokens(out)[1]) == 7
    # Every draft is accepted, but only drafts that reach the output count: rows 0 and 1 end inside
    # their second run (the stop token, the limit: 1 + 4 + 2 tokens) keeping one of its drafts;
    # row 2 takes 4 full steps (1 + 4 * 4 = 17). 8 steps, drafts kept at positions 0/1/2: 8/6/6.
    stats = out.timings.speculative
    assert stats.steps == 8 and stats.accepted == 20
    assert stats.acceptance_rate == [1.0, 0.75, 0.75]
    assert stats.mean_accepted_length == 3.5


def test_every_draft_rejected_at_position_zero(gen, prompts, plain):
    params, expected = plain
    spec = SpeculativeConfig("replay", 3, replay_tokens=_tokens(expected), replay_error_rate=1.0)
    out = gen.generate(prompts, params, speculative=spec)
    assert _tokens(out) == _tokens(expected)
    assert out.timings.speculative.accepted == 0 and out.timings.speculative.mean_accepted_length == 1.0


def test_logprobs_and_streaming_match_plain_decoding(gen, prompts, plain):
    _, expected = plain
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    reference = gen.generate(prompts, params)
    chunks = []
    spec = SpeculativeConfig("replay", 3, replay_tokens=_tokens(expected), replay_error_rate=0.3)
    out = gen.generate(prompts, params, speculative=spec, stream=chunks.append, stream_every=2)
    for got, want in zip(out.results, reference.results):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert_close("logprobs", np.array(list(a.values())), np.array(list(b.values())), tol=1e-4)
    streamed = {i: [] for i in range(3)}
    for c in chunks:
        streamed[c.index] += c.token_ids
    assert [streamed[i] for i in range(3)] == _tokens(out)


def test_sampled_generation_is_reproducible_with_a_seed(gen, prompts):
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, seed=5, n=2, ignore_eos=True)
    spec = SpeculativeConfig("mtp", 2)
    a = gen.generate(prompts, params, speculative=spec)
    b = gen.generate(prompts, params, speculative=spec)
    assert [[o.token_ids for o in r.outputs] for r in a.results] == [[o.token_ids for o in r.outputs] for r in b.results]
    assert all(len(o.token_ids) == 10 and all(0 <= t < VOCAB for t in o.token_ids) for r in a.results for o in r.outputs)


def _sampler(b, temperature=1.0, top_k=0, seed0=0):
    return SamplerInputs(temperature=jnp.full((b,), temperature, jnp.float32), top_k=jnp.full((b,), top_k, jnp.int32),
                         top_p=jnp.ones((b,), jnp.float32), seed=jnp.arange(seed0, seed0 + b, dtype=jnp.uint32),
                         repetition=jnp.ones((b,), jnp.float32), presence=jnp.zeros((b,), jnp.float32),
                         frequency=jnp.zeros((b,), jnp.float32))


@pytest.mark.parametrize("top_k", [0, 3])
def test_rejection_rule_keeps_the_target_distribution(top_k):
    """Each emitted position follows the target's (filtered) distribution whatever the draft."""
    b, v = 40_000, 5
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.1, 0.1, 0.2, 0.3], [0.2] * 5]))
    drafts = np.array([1, 4])  # a likely draft, then an unlikely one
    target, accepted = jax.jit(verify_tokens, static_argnames="filters")(
        jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (b, 3, v)), jnp.broadcast_to(jnp.asarray(drafts), (b, 2)),
        _sampler(b, top_k=top_k), jnp.zeros((b,), jnp.int32), filters=top_k > 0)
    target, accepted = np.asarray(target), np.asarray(accepted)

    def expected(p):
        p = np.exp(p)
        if top_k:
            p = np.where(p >= np.sort(p)[-top_k], p, 0)
        return p / p.sum()

    def frequencies(x):
        return np.bincount(x, minlength=v) / len(x)

    p0, p1 = expected(logits[0]), expected(logits[1])
    np.testing.assert_allclose(frequencies(target[:, 0]), p0, atol=0.01)
    np.testing.assert_allclose(np.mean(accepted >= 1), p0[1], atol=0.01)
    reached = accepted >= 1  # position 1 counts only where draft 0 was accepted
    np.testing.assert_allclose(frequencies(target[reached, 1]), p1, atol=0.015)
    assert np.all((accepted >= 1) == (target[:, 0] == drafts[0]))


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 7)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, -1))
    drafts = np.stack([best[0, :3], [best[1, 0], (best[1, 1] + 1) % 7, best[1, 2]]])
    target, accepted = verify_tokens(logits, jnp.asarray(drafts, jnp.int32), _sampler(2, temperature=0.0),
                                     jnp.zeros((2,), jnp.int32), filters=False)
    np.testing.assert_array_equal(np.asarray(target), best)
    np.testing.assert_array_equal(np.asarray(accepted), [3, 1])


def _lookup_reference(history, k, nmin, nmax):
    n_hist = len(history)
    for n in range(nmax, nmin - 1, -1):
        if n_hist <= n:
            continue
        suffix = history[-n:]
        for end in range(n_hist - 2, n - 2, -1):
            if history[end - n + 1:end + 1] == suffix:
                follow = [history[min(end + 1 + i, n_hist - 1)] for i in range(k)]
                return follow
    return [history[-1]] * k


def test_prompt_lookup_proposes_what_followed_the_latest_match(rng):
    rows = [list(rng.integers(0, 4, int(n))) for n in (1, 2, 7, 30, 30)]
    rows[4] = rows[4][:26] + rows[4][10:14]  # a 4-token suffix seen before
    width = 40
    history = np.zeros((len(rows), width), np.int32)
    for r, row in enumerate(rows):
        history[r, :len(row)] = row
    got = lookup(jnp.asarray(history), jnp.asarray([len(r) for r in rows], jnp.int32), k=3, ngram_min=1, ngram_max=4)
    assert np.asarray(got).tolist() == [_lookup_reference(row, 3, 1, 4) for row in rows]
    assert np.asarray(got)[4].tolist() == rows[4][14:17]


def _chain_reference(model, hidden, following, k, width=20):
    """Drafts by the windowed MTP layer (fresh attention over the whole window, no cache), the
    window left-padded to one width so that it compiles once."""
    hidden, following, drafts = list(hidden), list(following), []
    for _ in range(k):
        pad = width - len(hidden)
        h_in = np.concatenate([np.zeros((pad, len(hidden[0])), np.float32), np.stack(hidden)])[None]
        t_in = np.array([0] * pad + following)[None]
        mask = np.array([0] * pad + [1] * len(following))[None]
        positions = np.maximum(np.arange(width) - pad, 0)[None]
        h, logits = model.mtp(h_in, t_in, positions=positions, attention_mask=mask)
        drafts.append(int(np.argmax(logits[0, -1])))
        hidden.append(np.asarray(h[0, -1]))
        following.append(drafts[-1])
    return drafts


def test_mtp_drafts_equal_the_windowed_mtp_layer(model, rng):
    k, b, w = 3, 2, 10
    ids = rng.integers(0, VOCAB, (b, w))
    mask = np.ones((b, w), bool)
    mask[1, :3] = False
    first = rng.integers(0, VOCAB, (b,))
    window = np.concatenate([first[:, None], rng.integers(0, VOCAB, (b, k))], axis=1)
    full = np.asarray(model.hidden_states(np.concatenate([ids, window], 1), np.concatenate([mask, np.ones((b, k + 1), bool)], 1)))
    cache = MLACache(latent=jnp.zeros((b, 64, model.config.mla.latent_size), jnp.float32))
    source = MTPDrafts(k=k)
    prompt = PromptView(ids=jnp.asarray(ids), valid=jnp.asarray(mask), hidden=jnp.asarray(full[:, :w]),
                        first=jnp.asarray(first))
    # Compiled as in the verify loop (one program each instead of hundreds of eager ops).
    drafts, cache = jax.jit(functools.partial(source.init, model.graphdef))(model.params, prompt, cache)
    for row in range(b):
        toks = list(ids[row][mask[row]])
        expected = _chain_reference(model, full[row, :w][mask[row]], toks[1:] + [first[row]], k)
        assert np.asarray(drafts[row]).tolist() == expected, f"row {row} after prefill"

    # A verify step that accepted `a` drafts: window token i + 1 is the target's token i for i < a.
    accepted = np.array([1, 3])
    target = rng.integers(0, VOCAB, (b, k + 1))
    for row in range(b):
        target[row, :accepted[row]] = window[row, 1:accepted[row] + 1]
    start = mask.sum(1).astype(np.int32)
    outcome = VerifyOutcome(hidden=jnp.asarray(full[:, w:]), target=jnp.asarray(target, jnp.int32),
                            accepted=jnp.asarray(accepted, jnp.int32), start=jnp.asarray(start),
                            emitted=jnp.asarray(accepted + 1, jnp.int32), count=jnp.asarray(accepted + 2, jnp.int32))
    drafts, _ = jax.jit(functools.partial(source.next, model.graphdef))(model.params, cache, outcome)
    for row in range(b):
        a = accepted[row]
        seq = list(ids[row][mask[row]]) + list(window[row, :a + 1])
        hidden = np.concatenate([full[row, :w][mask[row]], full[row, w:w + a + 1]])
        expected = _chain_reference(model, hidden, seq[1:] + [target[row, a]], k)
        assert np.asarray(drafts[row]).tolist() == expected, f"row {row} after accepting {a}"


def test_bad_speculative_settings_are_named(gen, prompts):
    kimi_linear = k3jax.Generator(k3jax.CausalLM.random(k3jax.tiny_kimi_linear(), seed=0))
    with pytest.raises(ValueError, match="needs MTP layers"):
        kimi_linear.generate([1, 2, 3], SamplingParams(max_tokens=4), speculative=SpeculativeConfig("mtp"))
    with pytest.raises(ValueError, match="penalties are not supported with speculative"):
        gen.generate(prompts[0], SamplingParams(max_tokens=4, presence_penalty=0.5),
                     speculative=SpeculativeConfig("ngram"))
    with pytest.raises(ValueError, match="3 continuations for 1 completion rows"):
        gen.generate(prompts[0], SamplingParams(max_tokens=4),
                     speculative=SpeculativeConfig("replay", replay_tokens=[[1], [2], [3]]))
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer in"):
        SpeculativeConfig("ngram", num_draft_tokens=0)
    with pytest.raises(ValueError, match="speculative method must be one of"):
        SpeculativeConfig("eagle")
    with pytest.raises(ValueError, match="ngram_min and ngram_max"):
        SpeculativeConfig("ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="needs replay_tokens"):
        SpeculativeConfig("replay")
    with pytest.raises(ValueError, match="must be a SpeculativeConfig"):
        gen.generate(prompts[0], SamplingParams(max_tokens=4), speculative="ngram")
    with pytest.raises(ValueError, match="replay_error_rate must be a number in"):
        SpeculativeConfig("replay", replay_tokens=[[1]], replay_error_rate="0.5")
    with pytest.raises(ValueError, match="replay_tokens row 0 must hold non-negative integer token ids"):
        SpeculativeConfig("replay", replay_tokens=[[1, -2]])
    assert SpeculativeConfig("ngram", num_draft_tokens=np.int64(2)).num_draft_tokens == 2
