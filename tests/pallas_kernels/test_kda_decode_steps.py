"""Several decode steps in one call (speculative verify and commit) against separate one-token
calls, with and without per-row keep counts: the scan of one-token steps ("xla") and the one-kernel
form ("pallas", the state kept on chip across the tokens; interpret mode off the GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close, kernel_dtype

from pallas_kernels.kda import KDADecodeInputs, KDADecodeWeights, kda_decode, kda_decode_steps, kda_verify_outputs


def _inputs(rng, b, t, h, kd, width=4, low_rank_gate=False, rank=16, dtype=jnp.float32):
    """low_rank_gate: the output gate as g_a [B, T, R] with the weights' g_b (Kimi-Linear), else z
    [B, T, H, K] given (K3, with its bounded forget gate)."""
    r = lambda *shape, s=1.0, dt=jnp.float32: jnp.asarray(s * rng.standard_normal(shape), dt)
    gate = dict(g_a=r(b, t, rank, dt=dtype)) if low_rank_gate else dict(z=r(b, t, h, kd, dt=dtype))
    inputs = KDADecodeInputs(x_qkv=r(b, t, 3, h, kd, dt=dtype), f_a=r(b, t, rank, dt=dtype),
                             beta_logit=r(b, t, h, dt=dtype), **gate)
    factor = lambda: r(rank, h * kd, s=rank ** -0.5, dt=dtype)
    weights = KDADecodeWeights(q_conv=r(width, h, kd, s=0.5), k_conv=r(width, h, kd, s=0.5),
                               v_conv=r(width, h, kd, s=0.5), dt_bias=r(h, kd), a_log=r(h, kd), o_norm_w=r(kd),
                               f_b=factor(), g_b=factor() if low_rank_gate else None,
                               lower_bound=None if low_rank_gate else -5.0)
    return inputs, weights, r(b, width - 1, 3, h, kd, dt=dtype), r(b, h, kd, kd)


@pytest.mark.parametrize("impl,t,low_rank_gate", [("xla", 4, False), ("pallas", 4, False), ("pallas", 5, False),
                                                   ("xla", 3, True), ("pallas", 3, True)])
def test_steps_equal_one_token_calls_and_keep_stops_each_row(rng, interpret, impl, t, low_rank_gate):
    b, h, kd = 3, 2, 16
    inputs, weights, conv, state = _inputs(rng, b, t, h, kd, low_rank_gate=low_rank_gate)
    keep = np.array([0, 2, t], np.int32)
    out, all_conv, all_state = kda_decode_steps(inputs, weights, conv, state, impl=impl)
    _, new_conv, new_state = kda_decode_steps(inputs, weights, conv, state, keep=jnp.asarray(keep), impl=impl)
    c, s = conv, state
    outs, snapshots = [], [(c, s)]
    for i in range(t):
        o, c, s = kda_decode(jax.tree.map(lambda x: x[:, i], inputs), weights, c, s, impl=impl)
        outs.append(o)
        snapshots.append((c, s))
    assert_close("outputs", out, jnp.stack(outs, axis=1))
    assert_close("state after all tokens", all_state, snapshots[t][1])
    assert_close("conv after all tokens", all_conv, snapshots[t][0])
    for row, kept in enumerate(keep):
        assert_close(f"row {row} conv after {kept}", new_conv[row], snapshots[kept][0][row])
        assert_close(f"row {row} state after {kept}", new_state[row], snapshots[kept][1][row])
    assert not np.allclose(np.asarray(new_state[0]), np.asarray(new_state[2]))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("low_rank_gate", [True, False], ids=["low_rank_z", "full_rank_z"])
def test_verify_outputs_equal_the_steps_outputs(rng, interpret, impl, low_rank_gate):
    """The outputs-only window (the verify step: no state written) equals the full steps' outputs."""
    inputs, weights, conv, state = _inputs(rng, 2, 4, 2, 16, low_rank_gate=low_rank_gate)
    out = kda_verify_outputs(inputs, weights, conv, state, impl=impl)
    full, _, _ = kda_decode_steps(inputs, weights, conv, state, impl="xla")
    assert out.shape == full.shape
    assert_close("outputs only", out, full)


@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("low_rank_gate", [True, False], ids=["low_rank_z", "full_rank_z"])
def test_steps_kernel_folds_the_low_rank_gates(rng, interpret, b, low_rank_gate):
    """bf16 activations and gate weights (R = 64, several multiply chunks): the kernel's per-token
    f = f_a @ f_b (and z = g_a @ g_b) == the scan of the XLA twin's steps."""
    inputs, weights, conv, state = _inputs(rng, b, 3, 2, 32, low_rank_gate=low_rank_gate, rank=64,
                                           dtype=jnp.bfloat16)
    keep = jnp.asarray(rng.integers(0, 4, b), jnp.int32)
    out, new_conv, new_state = kda_decode_steps(inputs, weights, conv, state, keep=keep, impl="pallas")
    out_r, conv_r, state_r = kda_decode_steps(inputs, weights, conv, state, keep=keep, impl="xla")
    assert_close("outputs", out, out_r, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(new_conv, np.float32), np.asarray(conv_r, np.float32))
    assert_close("state", new_state, state_r, dtype=kernel_dtype("float32", interpret))


def test_steps_name_a_bad_keep(rng):
    inputs, weights, conv, state = _inputs(rng, 2, 3, 2, 16)
    with pytest.raises(ValueError, match=r"keep must be \[2\]"):
        kda_decode_steps(inputs, weights, conv, state, keep=jnp.zeros((3,), jnp.int32))
