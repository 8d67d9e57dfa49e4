"""The Mosaic GPU KDA decode step (`pallas_kernels/kda/decode_hopper.py`) against its XLA twin on fresh
random inputs: interpret mode on the CPU, compiled on a Hopper GPU (`K3JAX_TEST_DEVICE=gpu`). The ring is
exercised with more tiles per program than slots (slots reused, stores waited on before a reload), with one
program per tile, at both gate forms and both factor forms ("kernel": conv and gates inside; "xla": before the
launch), and under the interpret mode's race detector; the lowering for CUDA at the 48B shape (with the state and
conv window aliased in place) is checked on any host.

In interpret mode the kernel runs as host callbacks that dispatch JAX operations of their own: a test waits for its
outputs before it dispatches anything else (an operation queued meanwhile can wait on the running kernel while the
kernel's callbacks wait behind it: seen as a hang on a loaded 2-core machine)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close, kernel_dtype

from pallas_kernels.kda import (DecodeBlocks, HopperDecodeBlocks, KDADecodeInputs, KDADecodeWeights, kda_decode,
                                kda_decode_hopper, kda_decode_xla)


def _decode_inputs(rng, b, h, kd, width=4, dtype=jnp.bfloat16, lower_bound=None, a_shape=None):
    r = lambda *shape, dt=jnp.float32, s=1.0: jnp.asarray(s * rng.standard_normal(shape), dt)
    inputs = KDADecodeInputs(x_qkv=r(b, 3, h, kd, dt=dtype), f=r(b, h, kd, dt=dtype), beta_logit=r(b, h, dt=dtype),
                             z=r(b, h, kd, dt=dtype))
    weights = KDADecodeWeights(q_conv=r(width, h, kd, s=0.5), k_conv=r(width, h, kd, s=0.5),
                               v_conv=r(width, h, kd, s=0.5), dt_bias=r(h, kd), a_log=r(*(a_shape or (h, kd))),
                               o_norm_w=r(kd), lower_bound=lower_bound)
    return inputs, weights, r(b, width - 1, 3, h, kd, dt=dtype), r(b, h, kd, kd)


@pytest.mark.parametrize("factors", ["kernel", "xla"])
@pytest.mark.parametrize("b,h,kd,a_shape,lower_bound,stages,programs,state_dtype", [
    (5, 1, 64, None, None, 2, 1, "float32"),            # 5 tiles through 2 slots
    (3, 3, 64, (3, 1), -5.0, 3, 2, "float32"),          # 5 and 4 tiles a program, K3's gate
    (2, 2, 128, (1, 128), None, 0, 0, "float32"),       # the 48B head, the stages that fit, one program a tile
    (3, 2, 128, (2, 1), None, 0, 4, "bfloat16"),        # a bf16 state (8 x 64 swizzle tiles), 3 stages
])
def test_decode_step_equals_the_xla_twin(rng, interpret, factors, b, h, kd, a_shape, lower_bound, stages, programs,
                                         state_dtype):
    blocks = HopperDecodeBlocks(factors=factors, stages=stages, programs=programs)
    inputs, weights, conv, state = _decode_inputs(rng, b, h, kd, lower_bound=lower_bound, a_shape=a_shape)
    state = state.astype(state_dtype)
    out_r, conv_r, state_r = kda_decode_xla(inputs, weights, conv, state)
    out, new_conv, new_state = jax.block_until_ready(kda_decode(inputs, weights, conv, state, impl="hopper",
                                                                blocks=blocks, interpret=interpret))
    assert out.dtype == out_r.dtype and new_state.dtype == state.dtype
    assert_close("out", out, out_r, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(new_conv, np.float32), np.asarray(conv_r, np.float32))
    assert_close("state", new_state, state_r, dtype=kernel_dtype(state_dtype, interpret))
    assert np.all(np.asarray(out, np.float32) != 0)


@pytest.mark.parametrize("factors", ["kernel", "xla"])
def test_consecutive_steps_carry_the_state(rng, interpret, factors):
    """Three steps, each fed the last one's conv window and state, equal three twin steps."""
    inputs, weights, conv, state = _decode_inputs(rng, 2, 2, 64)
    ours = twin = (conv, state)
    blocks = HopperDecodeBlocks(factors=factors, stages=2, programs=3)
    for step in range(3):
        step_inputs = jax.tree.map(lambda x: x * (1.0 + 0.25 * step), inputs)
        out, *ours = jax.block_until_ready(kda_decode_hopper(step_inputs, weights, *ours, blocks=blocks,
                                                             interpret=interpret))
        out_r, *twin = kda_decode_xla(step_inputs, weights, *twin)
        assert_close(f"out {step}", out, out_r, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(ours[0], np.float32), np.asarray(twin[0], np.float32))
    assert_close("state", ours[1], twin[1], dtype=kernel_dtype("float32", interpret))


@pytest.mark.parametrize("factors", ["kernel", "xla"])
def test_the_ring_has_no_races(rng, factors):
    """Mosaic GPU's interpret mode with its happens-before race detector: five tiles through two slots, so every
    reload follows a store from the same buffer (without the wait for the stores' reads the "xla" form's reload
    races its store; the detector treats a warpgroup as one thread, so it says nothing within one)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    args = _decode_inputs(rng, 5, 1, 64)
    blocks = HopperDecodeBlocks(factors=factors, stages=2, programs=1)
    out = kda_decode_hopper(*args, blocks=blocks, interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(out)
    assert gpu_callbacks.get_races().races_found is False
    assert_close("out", out[0], kda_decode_xla(*args)[0], dtype="bfloat16")


@pytest.mark.parametrize("factors", ["kernel", "xla"])
def test_lowers_for_cuda_at_the_48b_shape_with_the_state_in_place(factors):
    """K = V = 128, B = 64, H = 32 lowers for CUDA on any host (Pallas -> Mosaic GPU, layout inference),
    and the state (with "kernel" also the conv window) is an aliased output (no copy of 268 MB a step)."""
    s = jax.ShapeDtypeStruct
    b, h, kd, width, bf, f32 = 64, 32, 128, 4, jnp.bfloat16, jnp.float32
    inputs = KDADecodeInputs(x_qkv=s((b, 3, h, kd), bf), f=s((b, h, kd), bf), beta_logit=s((b, h), bf),
                             z=s((b, h, kd), bf))
    weights = KDADecodeWeights(q_conv=s((width, h, kd), f32), k_conv=s((width, h, kd), f32),
                               v_conv=s((width, h, kd), f32), dt_bias=s((h, kd), f32), a_log=s((h, 1), f32),
                               o_norm_w=s((kd,), f32))

    def step(inputs, weights, conv, state):
        return kda_decode_hopper(inputs, weights, conv, state, blocks=HopperDecodeBlocks(factors=factors),
                                 interpret=False)

    exported = jax.export.export(jax.jit(step, donate_argnums=(2, 3)), platforms=["cuda"])(
        inputs, weights, s((b, width - 1, 3, h, kd), bf), s((b, h, kd, kd), f32))
    module = exported.mlir_module()
    [call] = [line for line in module.splitlines() if "mosaic_gpu" in line and "custom_call" in line]
    aliased = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d+)\]", call)
    assert aliased == (["1", "2"] if factors == "kernel" else ["1"])     # conv window, state: written in place


def test_refuses_what_it_cannot_run(rng):
    inputs, weights, conv, state = _decode_inputs(rng, 1, 2, 64)
    with pytest.raises(ValueError, match="needs an fp32 or bf16 state with K a multiple of 64, got float16"):
        kda_decode_hopper(inputs, weights, conv, state.astype(jnp.float16))
    small = _decode_inputs(rng, 1, 2, 32)
    with pytest.raises(ValueError, match="K a multiple of 64, got float32 and K=32"):
        kda_decode_hopper(*small)
    big = _decode_inputs(rng, 1, 1, 256)
    with pytest.raises(ValueError, match="stages=2 at K=V=256 need .* more than the 232448 B"):
        kda_decode_hopper(*big)
    with pytest.raises(ValueError, match="stages=3 at K=V=128 need .* more than the 232448 B"):
        HopperDecodeBlocks(stages=3).stages_for(128, 4)
    for bad in (dict(stages=1), dict(stages=-2), dict(stages=True), dict(programs=-1), dict(programs=2.0),
                dict(factors="triton")):
        with pytest.raises(ValueError, match="HopperDecodeBlocks: "):
            HopperDecodeBlocks(**bad)
    with pytest.raises(TypeError, match="impl 'hopper' takes HopperDecodeBlocks or None, got DecodeBlocks"):
        kda_decode(inputs, weights, conv, state, impl="hopper", blocks=DecodeBlocks())
    with pytest.raises(TypeError, match="impl 'xla' takes no blocks, got DecodeBlocks"):
        kda_decode(inputs, weights, conv, state, impl="xla", blocks=DecodeBlocks())


def test_stages_fill_the_shared_memory():
    assert HopperDecodeBlocks().stages_for(128, 4) == 2                 # factors in the kernel: 2 x 84 KB
    assert HopperDecodeBlocks(factors="xla").stages_for(128, 4) == 3    # 3 x 68 KB
    assert HopperDecodeBlocks().stages_for(64, 4) == 3
    assert HopperDecodeBlocks().stages_for(128, 4, state_bytes=2) == 3       # a bf16 state: 3 x 52 KB


def test_programs_follow_the_tiles():
    assert HopperDecodeBlocks().programs_for(32) == 32
    assert HopperDecodeBlocks().programs_for(2048) == 132        # one a multiprocessor off the GPU's report
    assert HopperDecodeBlocks(programs=7).programs_for(2048) == 7
    assert HopperDecodeBlocks(programs=7).programs_for(3) == 3
