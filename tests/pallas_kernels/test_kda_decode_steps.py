"""Several decode steps in one call (speculative verify and commit) against separate one-token
calls, with and without per-row keep counts: the scan of one-token steps ("xla") and the one-kernel
form ("pallas", the state kept on chip across the tokens; interpret mode off the GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

from pallas_kernels.kda import KDADecodeInputs, KDADecodeWeights, kda_decode, kda_decode_steps, kda_verify_outputs


def _inputs(rng, b, t, h, kd, width=4):
    r = lambda *shape, s=1.0: jnp.asarray(s * rng.standard_normal(shape), jnp.float32)
    inputs = KDADecodeInputs(x_qkv=r(b, t, 3, h, kd), f=r(b, t, h, kd), beta_logit=r(b, t, h), z=r(b, t, h, kd))
    weights = KDADecodeWeights(q_conv=r(width, h, kd, s=0.5), k_conv=r(width, h, kd, s=0.5),
                               v_conv=r(width, h, kd, s=0.5), dt_bias=r(h, kd), a_log=r(h, kd), o_norm_w=r(kd),
                               lower_bound=-5.0)
    return inputs, weights, r(b, width - 1, 3, h, kd), r(b, h, kd, kd)


@pytest.mark.parametrize("impl,t", [("xla", 4), ("pallas", 4), ("pallas", 5)])
def test_steps_equal_one_token_calls_and_keep_stops_each_row(rng, interpret, impl, t):
    b, h, kd = 3, 2, 16
    inputs, weights, conv, state = _inputs(rng, b, t, h, kd)
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
def test_verify_outputs_equal_the_steps_outputs(rng, interpret, impl):
    """The outputs-only window (the verify step: no state written) equals the full steps' outputs."""
    inputs, weights, conv, state = _inputs(rng, 2, 4, 2, 16)
    out = kda_verify_outputs(inputs, weights, conv, state, impl=impl)
    full, _, _ = kda_decode_steps(inputs, weights, conv, state, impl="xla")
    assert out.shape == full.shape
    assert_close("outputs only", out, full)


def test_steps_name_a_bad_keep(rng):
    inputs, weights, conv, state = _inputs(rng, 2, 3, 2, 16)
    with pytest.raises(ValueError, match=r"keep must be \[2\]"):
        kda_decode_steps(inputs, weights, conv, state, keep=jnp.zeros((3,), jnp.int32))
