"""KDA prefill of several sequences packed in one row (`kda_varlen_pallas`, interpret mode on the CPU,
compiled on a GPU) against its twin (one token scan with resets) and against running each sequence
alone through the recurrent reference; fresh random inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import TOLERANCES, assert_close, kernel_dtype

from pallas_kernels.kda import ChunkBlocks, kda_recurrent_reference, kda_varlen, kda_varlen_pallas, kda_varlen_reference


def _l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _packed(rng, lengths, h, kd, vd, gates, init):
    t = sum(lengths)
    q, k = (_l2(rng.standard_normal((1, t, h, kd))).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, t, h, vd)).astype(np.float32)
    g = rng.uniform(*gates, (1, t, h, kd)).astype(np.float32)
    beta = rng.uniform(0, 1, (1, t, h)).astype(np.float32)
    s0 = rng.standard_normal((len(lengths), h, kd, vd)).astype(np.float32) if init else None
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    return q, k, v, g, beta, cu, s0


@pytest.mark.parametrize("lengths,gates,init,dtype,intra", [
    ([5, 0, 37, 16, 1], (-1.0, 0.0), True, "float32", "blocked"),      # an empty sequence, lengths off the chunk
    ([33, 32, 7], (-40.0, -5.0), False, "float32", "blocked"),         # K3's bounded gate range and past it
    ([20, 44], (-1e3, -1e2), True, "float32", "blocked"),              # Kimi-Linear's unbounded gate
    ([17, 3, 30], (-1.0, 0.0), True, "bfloat16", "blocked"),
    ([5, 0, 37, 16, 1], (-1.0, 0.0), True, "float32", "parallel"),
    ([20, 44], (-1e3, -1e2), True, "bfloat16", "parallel"),
    ([17, 3, 30], (-1.0, 0.0), True, "bfloat16", "parallel/bf16"),     # bf16 factors between the passes
    ([40, 3, 70], (-1e3, -1e2), True, "bfloat16", "parallel/bf16/64"),   # 64-token chunks: pairs across sub-blocks
])
def test_varlen_equals_each_sequence_alone(rng, interpret, lengths, gates, init, dtype, intra):
    h, kd, vd = 2, 16, 16
    q, k, v, g, beta, cu, s0 = _packed(rng, lengths, h, kd, vd, gates, init)
    cast = lambda x: jnp.asarray(x, dtype)
    intra, *options = intra.split("/")     # "bf16": bf16 factors; "64": 64-token chunks (else 16)
    factors = "bfloat16" if "bf16" in options else "float32"
    o, s = kda_varlen_pallas(cast(q), cast(k), cast(v), g, beta, cu, initial_state=s0, interpret=interpret,
                             blocks=ChunkBlocks(chunk=64 if "64" in options else 16, value_block=16, intra=intra,
                                                factors=factors))
    f32 = lambda x: np.asarray(cast(x), np.float32)
    o_twin, s_twin = kda_varlen_reference(f32(q), f32(k), f32(v), g, beta, cu, initial_state=s0)
    assert o.dtype == jnp.dtype(dtype) and o.shape == (1, sum(lengths), h, vd) and s.shape == (len(lengths), h, kd, vd)
    assert_close("o vs twin", o, o_twin, dtype=kernel_dtype(dtype, interpret))
    assert_close("states vs twin", s, s_twin, tol=TOLERANCES[kernel_dtype(factors, interpret)])
    for i, (a, e) in enumerate(zip(np.asarray(cu[:-1]), np.asarray(cu[1:]))):
        init_i = np.zeros((1, h, kd, vd), np.float32) if s0 is None else s0[i:i + 1]
        if a == e:      # nothing to run: the state is the initial one
            np.testing.assert_array_equal(np.asarray(s[i]), init_i[0])
            continue
        piece = lambda x: f32(x)[:, a:e]
        o_i, s_i = kda_recurrent_reference(piece(q), piece(k), piece(v), g[:, a:e], beta[:, a:e], initial_state=init_i)
        assert_close(f"o of sequence {i}", o[:, a:e], o_i, dtype=kernel_dtype(dtype, interpret))
        assert_close(f"state of sequence {i}", s[i], s_i[0], tol=TOLERANCES[kernel_dtype(factors, interpret)])


def test_dispatch_names_both_implementations(rng, interpret):
    q, k, v, g, beta, cu, s0 = _packed(rng, [9, 23], 1, 16, 16, (-1.0, 0.0), True)
    out = {impl: kda_varlen(q, k, v, g, beta, cu, initial_state=s0, impl=impl, chunk_size=16)
           for impl in ("pallas", "recurrent")}
    assert_close("o", out["pallas"][0], out["recurrent"][0], dtype=kernel_dtype("float32", interpret))
    with pytest.raises(ValueError, match="unknown impl"):
        kda_varlen(q, k, v, g, beta, cu, impl="chunked")


@pytest.mark.parametrize("cu,message", [
    ([1, 5, 10], "rise from 0"), ([0, 6, 4, 10], "rise from 0"), ([0, 4, 9], "rise from 0"),
    ([10], "S >= 1"),
])
def test_bad_offsets_are_refused(rng, cu, message):
    q, k, v, g, beta, _, _ = _packed(rng, [4, 6], 1, 16, 16, (-1.0, 0.0), False)
    with pytest.raises(ValueError, match=message):
        kda_varlen_pallas(q, k, v, g, beta, jnp.asarray(cu, jnp.int32))


def test_bad_shapes_are_refused(rng):
    q, k, v, g, beta, cu, s0 = _packed(rng, [4, 6], 1, 16, 16, (-1.0, 0.0), True)
    with pytest.raises(ValueError, match="B must be 1"):
        kda_varlen_pallas(*(np.concatenate([x, x]) for x in (q, k, v, g, beta)), cu)
    with pytest.raises(ValueError, match="initial_state"):
        kda_varlen_pallas(q, k, v, g, beta, cu, initial_state=s0[:1])
    with pytest.raises(ValueError, match="integer"):
        kda_varlen_pallas(q, k, v, g, beta, cu.astype(jnp.float32))
    with pytest.raises(ValueError, match="inter='fused' only"):
        kda_varlen_pallas(q, k, v, g, beta, cu, blocks=ChunkBlocks(inter="split"))
