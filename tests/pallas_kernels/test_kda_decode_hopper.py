"""The Mosaic GPU KDA decode step (`pallas_kernels/kda/decode_hopper.py`) against its XLA twin on fresh
random inputs: interpret mode on the CPU, compiled on a Hopper GPU (`K3JAX_TEST_DEVICE=gpu`).

Covered: more tiles per program than slots (slots reused after the stores' reads), one program per tile, both
gate forms, both factor forms ("kernel": conv and gates inside; "xla": before the launch), both refill points,
fp32 and bf16 states, fp32 activations and conv windows of 2 to 4 taps; the ring under the interpret mode's race
detector (which treats a warpgroup as one thread and, in the "kernel" form, does not see a reload racing its
store: so the loop's synchronisation is also checked in the kernel's jaxpr); the lowering for CUDA at the 48B
shape with the state and conv window aliased in place, and at K = 64 (any host). The "kernel" form takes K a
multiple of 128 (it does not lower at 64), so its cases run at K = 128.

In interpret mode the kernel runs as host callbacks that dispatch JAX operations of their own: a test waits for its
outputs before it dispatches anything else (an operation queued meanwhile can wait on the running kernel while the
kernel's callbacks wait behind it: seen as a hang on a loaded 2-core machine)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core
from kda_decode_inputs import decode_inputs
from tolerances import assert_close, kernel_dtype

from pallas_kernels._util import multiprocessor_count
from pallas_kernels.kda import (DecodeBlocks, HopperDecodeBlocks, KDADecodeInputs, KDADecodeWeights, kda_decode,
                                kda_decode_hopper, kda_decode_xla)


@pytest.mark.parametrize("factors", ["kernel", "xla"])
@pytest.mark.parametrize("b,h,kd,a_shape,lower_bound,state_dtype,extra", [
    (5, 1, 128, None, None, "float32", dict(stages=2, programs=1)),                # 5 tiles through 2 slots
    (3, 3, 128, (3, 1), -5.0, "float32", dict(programs=2)),                       # 5 and 4 tiles, K3's gate
    (2, 2, 128, (1, 128), None, "float32", {}),                  # the stages that fit, one program a tile
    (7, 1, 128, (1, 1), None, "bfloat16", dict(programs=1)),     # a bf16 state (8 x 64 swizzle), 7 tiles, 3 slots
    (5, 1, 128, None, -5.0, "float32", dict(stages=2, programs=1, refill="after")),
    (5, 1, 128, None, None, "bfloat16", dict(stages=3, programs=1, refill="after")),
])
def test_decode_step_equals_the_xla_twin(rng, interpret, factors, b, h, kd, a_shape, lower_bound, state_dtype, extra):
    blocks = HopperDecodeBlocks(factors=factors, **extra)
    inputs, weights, conv, state = decode_inputs(rng, b, h, kd, lower_bound=lower_bound, a_shape=a_shape)
    state = state.astype(state_dtype)
    out_r, conv_r, state_r = kda_decode_xla(inputs, weights, conv, state)
    out, new_conv, new_state = jax.block_until_ready(kda_decode(inputs, weights, conv, state, impl="hopper",
                                                                blocks=blocks, interpret=interpret))
    assert out.dtype == out_r.dtype and new_state.dtype == state.dtype
    assert_close("out", out, out_r, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(new_conv, np.float32), np.asarray(conv_r, np.float32))
    # compiled, a bf16 rounding of one conv output can flip (another order of the taps, Mosaic's exp): tf32 bounds
    assert_close("state", new_state, state_r, dtype=kernel_dtype(state_dtype, interpret))
    assert np.all(np.asarray(out, np.float32) != 0)


@pytest.mark.parametrize("b,h,extra", [(5, 1, dict(stages=2, programs=1)), (2, 3, {})])
def test_k64_takes_the_xla_factors(rng, interpret, b, h, extra):
    """At K = 64 "auto" runs the "xla" form (the "kernel" form does not lower there); equal to the twin."""
    blocks = HopperDecodeBlocks(factors="auto", **extra)
    assert blocks.factors_for(64) == "xla" and blocks.factors_for(128) == "kernel"
    assert HopperDecodeBlocks().factors_for(128) == "xla"          # the default: the factors made by XLA
    args = decode_inputs(rng, b, h, 64, lower_bound=-5.0)
    out_r, conv_r, state_r = kda_decode_xla(*args)
    out, new_conv, new_state = jax.block_until_ready(kda_decode_hopper(*args, blocks=blocks, interpret=interpret))
    assert_close("out", out, out_r, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(new_conv, np.float32), np.asarray(conv_r, np.float32))
    assert_close("state", new_state, state_r, dtype=kernel_dtype("float32", interpret))


@pytest.mark.parametrize("factors", ["kernel", "xla"])
@pytest.mark.parametrize("width,dtype,conv_dtype", [(2, "float32", None), (3, "bfloat16", "float32")])
def test_other_widths_and_dtypes(rng, interpret, factors, width, dtype, conv_dtype):
    """Conv windows of 2 and 3 taps, fp32 activations, an fp32 conv window under bf16 activations (the new
    window's token cast to it, as the twin casts it)."""
    args = decode_inputs(rng, 3, 2, 128, width=width, dtype=dtype, conv_dtype=conv_dtype)
    out_r, conv_r, state_r = kda_decode_xla(*args)
    out, new_conv, new_state = jax.block_until_ready(
        kda_decode_hopper(*args, blocks=HopperDecodeBlocks(factors=factors, programs=2), interpret=interpret))
    assert out.dtype == out_r.dtype and new_conv.dtype == conv_r.dtype
    assert_close("out", out, out_r, dtype=dtype)
    np.testing.assert_array_equal(np.asarray(new_conv), np.asarray(conv_r))
    assert_close("state", new_state, state_r, dtype=kernel_dtype("float32", interpret))


@pytest.mark.parametrize("factors", ["kernel", "xla"])
def test_consecutive_steps_carry_the_state(rng, interpret, factors):
    """Three steps, each fed the last one's conv window and state, equal three twin steps."""
    inputs, weights, conv, state = decode_inputs(rng, 2, 2, 128)
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
    reload follows a store from the same buffer. Without the wait for the stores' reads it reports the "xla"
    form's reload racing its store; in the "kernel" form it does not see that race (a `commit_smem` between them
    orders them in the interpreter, not on the GPU), hence the jaxpr test below."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    args = decode_inputs(rng, 5, 1, 128)
    blocks = HopperDecodeBlocks(factors=factors, stages=2, programs=1)
    out = kda_decode_hopper(*args, blocks=blocks, interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(out)
    assert gpu_callbacks.get_races().races_found is False
    assert_close("out", out[0], kda_decode_xla(*args)[0], dtype="bfloat16")


_SYNC = {"barrier_wait", "commit_smem", "copy_gmem_to_smem", "copy_smem_to_gmem", "wait_smem_to_gmem"}


def _sync_skeleton(jaxpr):
    """The loop body's synchronisation in program order: a name per copy, wait and fence; a cond as its branches."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            out.append([_sync_skeleton(branch.jaxpr) for branch in eqn.params["branches"]])
        elif eqn.primitive.name == "wait_smem_to_gmem":
            out.append(f"wait_stores_read(pending={eqn.params['n']})" if eqn.params["wait_read_only"] else "wait")
        elif eqn.primitive.name in _SYNC:
            assert eqn.params.get("commit_group", True)      # a store is its own bulk group (the waits count them)
            out.append(eqn.primitive.name)
    return out


def _loop_body(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            return eqn.params["body_jaxpr"].jaxpr
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = sub.jaxpr if isinstance(sub, jex_core.ClosedJaxpr) else sub
                if isinstance(sub, jex_core.Jaxpr) and (found := _loop_body(sub)) is not None:
                    return found
    return None


@pytest.mark.parametrize("refill", ["before", "after"])
@pytest.mark.parametrize("factors", ["kernel", "xla"])
def test_a_slot_is_refilled_only_after_its_stores_read_it(rng, factors, refill):
    """The step's copies, waits and fences in program order (the kernel's jaxpr): the refill of tile i - 1's slot
    sits behind a wait for that tile's stores to have read their buffers (with "after", this tile's stores left in
    flight), and every TMA store behind a fence of the warpgroup's shared-memory writes."""
    args = decode_inputs(rng, 2, 2, 128)
    blocks = HopperDecodeBlocks(factors=factors, refill=refill)
    body = _loop_body(jax.make_jaxpr(lambda *a: kda_decode_hopper(*a, blocks=blocks, interpret=False))(*args).jaxpr)
    loads, stores = (6, 3) if factors == "kernel" else (2, 2)
    refill_cond = [[], [f"wait_stores_read(pending={0 if refill == 'before' else stores})"]
                   + ["copy_gmem_to_smem"] * loads]
    factor_fence = ["commit_smem"] if factors == "kernel" else []
    store = ["commit_smem"] + ["copy_smem_to_gmem"] * stores
    expected = (["barrier_wait"] + factor_fence
                + ([refill_cond] + store if refill == "before" else store + [refill_cond]))
    assert _sync_skeleton(body) == expected


@pytest.mark.parametrize("factors,kd", [("kernel", 128), ("xla", 128), ("auto", 64)])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_lowers_for_cuda_with_the_state_in_place(factors, kd, state_dtype):
    """B = 64, H = 32 at the 48B head (K = V = 128), and K = 64, lower for CUDA on any host (Pallas -> Mosaic GPU,
    layout inference), and the state (with "kernel" also the conv window) is an aliased output (no copy of 268 MB
    a step)."""
    s = jax.ShapeDtypeStruct
    b, h, width, bf, f32 = 64, 32, 4, jnp.bfloat16, jnp.float32
    inputs = KDADecodeInputs(x_qkv=s((b, 3, h, kd), bf), f=s((b, h, kd), bf), beta_logit=s((b, h), bf),
                             z=s((b, h, kd), bf))
    weights = KDADecodeWeights(q_conv=s((width, h, kd), f32), k_conv=s((width, h, kd), f32),
                               v_conv=s((width, h, kd), f32), dt_bias=s((h, kd), f32), a_log=s((h, 1), f32),
                               o_norm_w=s((kd,), f32))

    def step(inputs, weights, conv, state):
        return kda_decode_hopper(inputs, weights, conv, state, blocks=HopperDecodeBlocks(factors=factors),
                                 interpret=False)

    exported = jax.export.export(jax.jit(step, donate_argnums=(2, 3)), platforms=["cuda"])(
        inputs, weights, s((b, width - 1, 3, h, kd), bf), s((b, h, kd, kd), jnp.dtype(state_dtype)))
    module = exported.mlir_module()
    [call] = [line for line in module.splitlines() if "mosaic_gpu" in line and "custom_call" in line]
    aliased = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d+)\]", call)
    fused = HopperDecodeBlocks(factors=factors).factors_for(kd) == "kernel"
    assert aliased == (["1", "2"] if fused else ["1"])                  # conv window, state: written in place


def test_refuses_what_it_cannot_run(rng):
    inputs, weights, conv, state = decode_inputs(rng, 1, 2, 64)
    with pytest.raises(ValueError, match="needs an fp32 or bf16 state with K a multiple of 64, got float16"):
        kda_decode_hopper(inputs, weights, conv, state.astype(jnp.float16))
    small = decode_inputs(rng, 1, 2, 32)
    with pytest.raises(ValueError, match="K a multiple of 64, got float32 and K=32"):
        kda_decode_hopper(*small)
    big = decode_inputs(rng, 1, 1, 256)
    with pytest.raises(ValueError, match="stages=2 at K=V=256 need .* more than the 232448 B"):
        kda_decode_hopper(*big)
    with pytest.raises(ValueError, match="stages=3 at K=V=128 need .* more than the 232448 B"):
        HopperDecodeBlocks(factors="kernel", stages=3).stages_for(128, 4, {})
    with pytest.raises(ValueError, match="factors='kernel' needs K a multiple of 128 .* at K=64"):
        kda_decode_hopper(inputs, weights, conv, state, blocks=HopperDecodeBlocks(factors="kernel"))
    for bad in (dict(stages=1), dict(stages=-2), dict(stages=True), dict(programs=-1), dict(programs=2.0),
                dict(factors="triton"), dict(refill="never")):
        with pytest.raises(ValueError, match="HopperDecodeBlocks: "):
            HopperDecodeBlocks(**bad)
    with pytest.raises(TypeError, match="impl 'hopper' takes HopperDecodeBlocks or None, got DecodeBlocks"):
        kda_decode(inputs, weights, conv, state, impl="hopper", blocks=DecodeBlocks())
    with pytest.raises(TypeError, match="impl 'xla' takes no blocks, got DecodeBlocks"):
        kda_decode(inputs, weights, conv, state, impl="xla", blocks=DecodeBlocks())


def test_stages_fill_the_shared_memory():
    """The count of `buffers` as Pallas Mosaic GPU allocates them (each aligned to 1 KB, its 2 KB reduction scratch
    and the barriers' 1 KB): 176,128 B at K = V = 128, W = 4, fp32, 2 stages, "kernel", as its lowering counts
    (without the barriers)."""
    f32 = dict(state="float32")
    fused = HopperDecodeBlocks(factors="kernel")
    assert fused.smem_bytes(2, 128, 4, f32) == 176_128 + 1024
    assert fused.stages_for(128, 4, f32) == 2                                # factors in the kernel
    assert HopperDecodeBlocks().stages_for(128, 4, f32) == 3                 # the default: "xla"
    assert HopperDecodeBlocks(factors="auto").stages_for(64, 4, f32) == 3
    assert fused.stages_for(128, 4, dict(state="bfloat16")) == 3
    for blocks in (HopperDecodeBlocks(), HopperDecodeBlocks(factors="auto")):
        assert not blocks.fits(192, 4, f32) and blocks.fits(192, 4, dict(state="bfloat16"))


def test_programs_follow_the_tiles():
    assert HopperDecodeBlocks().programs_for(32) == min(32, multiprocessor_count())
    assert HopperDecodeBlocks().programs_for(4096) == multiprocessor_count()
    assert HopperDecodeBlocks(programs=7).programs_for(2048) == 7
    assert HopperDecodeBlocks(programs=7).programs_for(3) == 3
