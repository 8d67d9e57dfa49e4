"""The token draw of `k3jax.sampling`: our Threefry-2x32 against JAX's own, the Gumbel-max draw's
frequencies against the softmax it samples, and its dependence on (seed, position) only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.random import threefry_2x32

from k3jax.sampling import SamplerInputs, gumbel_argmax, sample, threefry2x32


def test_threefry_matches_jax(rng):
    key = rng.integers(0, 2 ** 32, size=2, dtype=np.uint32)
    count = rng.integers(0, 2 ** 32, size=2 * 257, dtype=np.uint32)
    x0, x1 = threefry2x32(key[0], key[1], count[:257], count[257:])
    expected = np.asarray(threefry_2x32(jnp.asarray(key), jnp.asarray(count)))
    np.testing.assert_array_equal(np.concatenate([np.asarray(x0), np.asarray(x1)]), expected)


@pytest.mark.parametrize("masked", [False, True])
def test_gumbel_draw_follows_the_softmax(rng, masked):
    """40,000 rows of one distribution (a seed each): frequencies within 0.01 of the softmax;
    entries at -inf (filtered out) never drawn."""
    b = 40_000
    probs = rng.dirichlet(np.ones(6))
    logits = np.log(probs).astype(np.float32)
    if masked:
        logits[2] = -np.inf
        probs[2] = 0
        probs /= probs.sum()
    seeds = jnp.asarray(rng.integers(0, 2 ** 32, size=b, dtype=np.uint32))
    drawn = np.asarray(jax.jit(gumbel_argmax)(jnp.broadcast_to(jnp.asarray(logits), (b, 6)), seeds,
                                              jnp.full((b,), 7, jnp.int32)))
    np.testing.assert_allclose(np.bincount(drawn, minlength=6) / b, probs, atol=0.01)
    if masked:
        assert not np.any(drawn == 2)


def test_draw_depends_on_seed_and_position_only(rng):
    b, v = 64, 1000
    logits = jnp.asarray(rng.normal(size=(b, v)), jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 2 ** 32, size=b, dtype=np.uint32))
    pos = jnp.asarray(rng.integers(0, 4096, size=b), jnp.int32)
    draw = jax.jit(gumbel_argmax)
    first = np.asarray(draw(logits, seeds, pos))
    order = rng.permutation(b)
    np.testing.assert_array_equal(np.asarray(draw(logits[order], seeds[order], pos[order])), first[order])
    assert np.mean(np.asarray(draw(logits, seeds, pos + 1)) != first) > 0.5
    assert np.mean(np.asarray(draw(logits, seeds + 1, pos)) != first) > 0.5


def test_sample_mixes_greedy_and_drawn_rows(rng):
    b, v = 4, 50
    logits = jnp.asarray(rng.normal(size=(b, v)) * 3, jnp.float32)
    temp = jnp.asarray([0.0, 1.0, 0.0, 1.0], jnp.float32)
    params = SamplerInputs(temperature=temp, top_k=jnp.zeros((b,), jnp.int32), top_p=jnp.ones((b,), jnp.float32),
                           seed=jnp.arange(b, dtype=jnp.uint32), repetition=jnp.ones((b,), jnp.float32),
                           presence=jnp.zeros((b,), jnp.float32), frequency=jnp.zeros((b,), jnp.float32))
    pos = jnp.full((b,), 3, jnp.int32)
    tokens = np.asarray(sample(logits, params, pos, filters=False))
    greedy = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(tokens[[0, 2]], greedy[[0, 2]])
    np.testing.assert_array_equal(tokens[[1, 3]], np.asarray(gumbel_argmax(logits, params.seed, pos))[[1, 3]])
