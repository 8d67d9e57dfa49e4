"""The pure-JAX KDA forms (recurrent reference, chunked WY form) against fla's naive KDA (an outside
oracle) and against each other."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

from pallas_kernels.kda import kda, kda_chunk_xla, kda_recurrent_reference


def _l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def random_inputs(rng, b, t, h, k, v, gate_range=(-1.0, 0.0), initial_state=True, dtype=np.float32):
    q = _l2(rng.standard_normal((b, t, h, k))).astype(dtype)
    kk = _l2(rng.standard_normal((b, t, h, k))).astype(dtype)
    vv = rng.standard_normal((b, t, h, v)).astype(dtype)
    g = rng.uniform(*gate_range, (b, t, h, k)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
    s0 = rng.standard_normal((b, h, k, v)).astype(np.float32) if initial_state else None
    return q, kk, vv, g, beta, s0


@pytest.fixture(scope="module")
def fla_cases(oracle_dir):
    data = np.load(oracle_dir / "fla" / "kda_cases.npz")
    meta = json.loads((oracle_dir / "fla" / "kda_cases.json").read_text())
    return data, meta


@pytest.mark.parametrize("case", ["moderate", "uneven_dims", "gates_at_floor"])
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_matches_fla_naive_recurrent(fla_cases, case, form):
    data, meta = fla_cases
    get = lambda n: jnp.asarray(data[f"{case}/{n}"])
    s0 = get("s0") if meta[case]["initial_state"] else None
    o, s = kda(get("q"), get("k"), get("v"), get("g"), get("beta"), initial_state=s0, impl=form, chunk_size=32)
    assert_close(f"{case}/{form} o", o, data[f"{case}/o_recurrent"])
    assert_close(f"{case}/{form} state", s, data[f"{case}/s_recurrent"])


@pytest.mark.parametrize("case", ["moderate", "uneven_dims"])
def test_chunked_matches_fla_naive_chunk(fla_cases, case):
    data, meta = fla_cases
    assert meta[case]["fla_chunk"]
    get = lambda n: jnp.asarray(data[f"{case}/{n}"])
    s0 = get("s0") if meta[case]["initial_state"] else None
    o, s = kda_chunk_xla(get("q"), get("k"), get("v"), get("g"), get("beta"), initial_state=s0, chunk_size=64)
    assert_close(f"{case} o", o, data[f"{case}/o_chunk"])
    assert_close(f"{case} state", s, data[f"{case}/s_chunk"])


@pytest.mark.parametrize("shape,chunk", [((2, 37, 3, 16, 8), 16), ((1, 64, 2, 8, 8), 64), ((3, 5, 1, 8, 16), 4),
                                         ((1, 100, 4, 16, 16), 32)])
@pytest.mark.parametrize("initial_state", [False, True])
def test_chunked_equals_recurrent(rng, shape, chunk, initial_state):
    q, k, v, g, beta, s0 = random_inputs(rng, *shape, initial_state=initial_state)
    o_r, s_r = kda_recurrent_reference(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = kda_chunk_xla(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    assert_close("o", o_c, o_r)
    assert_close("state", s_c, s_r)


@pytest.mark.parametrize("gate_range", [(-5.0, -4.9), (-60.0, -20.0), (-1e4, -1e3)])
def test_chunked_never_overflows_for_strongly_negative_gates(rng, gate_range):
    """Gates at (and far past) K3's floor: cumulative decays reach -3e5 within a chunk."""
    q, k, v, g, beta, s0 = random_inputs(rng, 1, 300, 2, 16, 16, gate_range=gate_range)
    o_r, s_r = kda_recurrent_reference(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = kda_chunk_xla(q, k, v, g, beta, initial_state=s0, chunk_size=64)
    assert_close("o", o_c, o_r)
    assert_close("state", s_c, s_r)


def test_bf16_inputs(rng):
    q, k, v, g, beta, s0 = random_inputs(rng, 2, 50, 2, 16, 16)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    o_c, s_c = kda_chunk_xla(bf(q), bf(k), bf(v), g, beta, initial_state=s0, chunk_size=16)
    assert o_c.dtype == jnp.bfloat16 and s_c.dtype == jnp.float32
    # Same bf16-rounded inputs through the fp32 recurrent reference.
    f = lambda x: np.asarray(bf(x), np.float32)
    o_r, s_r = kda_recurrent_reference(f(q), f(k), f(v), g, beta, initial_state=s0)
    assert_close("o", o_c, o_r, dtype="bfloat16")
    assert_close("state", s_c, s_r, tol=1e-5)


def test_validation_names_the_bad_input(rng):
    q, k, v, g, beta, s0 = random_inputs(rng, 1, 8, 2, 8, 8)
    with pytest.raises(ValueError, match="beta must have shape"):
        kda(q, k, v, g, beta[:, :, :1])
    with pytest.raises(ValueError, match="initial_state must have shape"):
        kda(q, k, v, g, beta, initial_state=s0[:, :1])
    with pytest.raises(ValueError, match="unknown impl"):
        kda(q, k, v, g, beta, impl="fast")
