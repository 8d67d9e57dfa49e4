"""Pallas KDA kernels (interpret mode on CPU) against their pure-JAX twins, fresh random inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

from pallas_kernels.kda import kda_decode, kda_decode_reference, kda_recurrent_reference
from pallas_kernels.kda.chunk import kda_chunk_pallas
from pallas_kernels.kda.tuning import ChunkBlocks


def _l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize("b,t,h,kd,vd,chunk,gates,init,dtype,intra", [
    (2, 37, 2, 16, 16, 32, (-1.0, 0.0), True, "float32", "blocked"),     # T not a multiple of the chunk
    (1, 64, 3, 16, 32, 64, (-0.5, 0.0), False, "float32", "blocked"),    # three heads, V != K
    (1, 50, 1, 32, 16, 32, (-40.0, -5.0), True, "float32", "blocked"),   # gates at and far past K3's floor
    (1, 40, 2, 16, 16, 32, (-1e3, -1e2), True, "float32", "blocked"),    # unbounded (Kimi-Linear) gates
    (2, 24, 2, 16, 16, 16, (-1.0, 0.0), True, "bfloat16", "blocked"),
    (2, 37, 2, 16, 16, 16, (-30.0, 0.0), True, "float32", "column"),
])
def test_chunk_kernel_matches_recurrent_reference(rng, b, t, h, kd, vd, chunk, gates, init, dtype, intra):
    q = _l2(rng.standard_normal((b, t, h, kd)))
    k = _l2(rng.standard_normal((b, t, h, kd)))
    v = rng.standard_normal((b, t, h, vd))
    g = rng.uniform(*gates, (b, t, h, kd)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
    s0 = rng.standard_normal((b, h, kd, vd)).astype(np.float32) if init else None
    cast = lambda x: jnp.asarray(x, dtype)
    o, s = kda_chunk_pallas(cast(q), cast(k), cast(v), g, beta, initial_state=s0,
                            blocks=ChunkBlocks(chunk=chunk, value_block=16, intra=intra), interpret=True)
    f32 = lambda x: np.asarray(cast(x), np.float32)
    o_ref, s_ref = kda_recurrent_reference(f32(q), f32(k), f32(v), g, beta, initial_state=s0)
    assert o.dtype == jnp.dtype(dtype) and o.shape == (b, t, h, vd)
    assert_close("o", o, o_ref, dtype=dtype)
    assert_close("state", s, s_ref, tol=1e-5)
    assert np.all(np.asarray(o, np.float32) != 0) or gates[1] <= -1e2  # every element written


def _decode_inputs(rng, b, h, kd, width=4, dtype=jnp.bfloat16):
    r = lambda *shape, dt=jnp.float32, s=1.0: jnp.asarray(s * rng.standard_normal(shape), dt)
    return (r(b, 3, h, kd, dt=dtype), r(b, width - 1, 3, h, kd, dt=dtype), r(width, 3, h, kd, s=0.5),
            r(b, h, kd, dt=dtype), r(h, kd), jnp.exp(r(h, kd)), r(b, h, dt=dtype), r(b, h, kd, dt=dtype),
            r(kd), r(b, h, kd, kd))


@pytest.mark.parametrize("b,h,kd", [(1, 2, 16), (3, 4, 32), (2, 3, 16)])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_decode_kernel_matches_reference(rng, b, h, kd, lower_bound):
    args = _decode_inputs(rng, b, h, kd)
    out, conv, state = kda_decode(*args, lower_bound=lower_bound, interpret=True)
    out_r, conv_r, state_r = kda_decode_reference(*args, lower_bound=lower_bound)
    assert_close("out", out, out_r, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(conv, np.float32), np.asarray(conv_r, np.float32))
    assert_close("state", state, state_r)
    assert np.all(np.asarray(out, np.float32) != 0)


def test_decode_reference_agrees_with_the_recurrence(rng):
    """The fused step's recurrence part is the same delta rule as the sequence reference."""
    b, h, kd = 2, 2, 16
    args = list(_decode_inputs(rng, b, h, kd, dtype=jnp.float32))
    args[1] = jnp.zeros_like(args[1])
    args[2] = jnp.zeros_like(args[2]).at[-1].set(1.0)  # conv = identity on the current token
    _, _, state = kda_decode_reference(*args)
    x = np.asarray(args[0])
    silu = lambda z: z / (1 + np.exp(-z))
    q, k, v = (silu(x[:, i]) for i in range(3))
    u = np.asarray(args[3]) + np.asarray(args[4])
    g = -np.asarray(args[5]) * np.logaddexp(0, u)
    beta = 1 / (1 + np.exp(-np.asarray(args[6])))
    _, s_ref = kda_recurrent_reference(_l2(q)[:, None], _l2(k)[:, None], v[:, None], g[:, None], beta[:, None],
                                       initial_state=args[9])
    assert_close("state", state, s_ref)
