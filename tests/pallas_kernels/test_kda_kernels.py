"""Pallas KDA kernels (interpret mode on CPU, compiled on a GPU) against their pure-JAX twins and
the recurrent reference, fresh random inputs."""

from __future__ import annotations

from dataclasses import fields, replace

import jax.numpy as jnp
import numpy as np
import pytest
from kda_decode_inputs import decode_inputs
from kernel_matrix import covering_rows
from tolerances import TOLERANCES, assert_close, kernel_dtype

from pallas_kernels.kda import (ChunkBlocks, DecodeBlocks, KDADecodeWeights, kda_chunk_pallas,
                                kda_decode_pallas, kda_decode_xla, kda_recurrent_reference)
from pallas_kernels.kda.tuning import ONE_WAVE_STAGES, STAGE_SHARED_BYTES


def _l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


# b, t, h, kd, vd, chunk, gates, init, dtype, intra (the form, then its options: see the test)
CHUNK_ROWS = [
    (2, 37, 2, 16, 16, 32, (-1.0, 0.0), True, "float32", "blocked"),     # T not a multiple of the chunk
    (1, 64, 3, 16, 32, 64, (-0.5, 0.0), False, "float32", "blocked"),    # three heads, V != K
    (1, 50, 1, 32, 16, 32, (-40.0, -5.0), True, "float32", "blocked"),   # gates at and far past K3's floor
    (1, 40, 2, 16, 16, 32, (-1e3, -1e2), True, "float32", "blocked"),    # unbounded (Kimi-Linear) gates
    (2, 24, 2, 16, 16, 16, (-1.0, 0.0), True, "bfloat16", "blocked"),
    (2, 37, 2, 16, 16, 16, (-30.0, 0.0), True, "float32", "column"),
    (2, 37, 2, 16, 16, 32, (-1.0, 0.0), True, "float32", "parallel"),
    (1, 64, 3, 16, 32, 64, (-0.5, 0.0), False, "float32", "parallel"),
    (1, 50, 1, 32, 16, 32, (-40.0, -5.0), True, "float32", "parallel"),
    (1, 40, 2, 16, 16, 32, (-1e3, -1e2), True, "float32", "parallel"),
    (1, 130, 1, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel"),  # two key slices, three chunks
    (2, 24, 2, 16, 16, 16, (-1.0, 0.0), True, "bfloat16", "parallel"),   # one sub-block per chunk
    (1, 70, 1, 64, 32, 64, (-3e3, -1e-4), True, "float32", "parallel"),  # key_slice 32 (default), big gates
    (1, 40, 2, 16, 16, 32, (-1e3, -1e2), True, "float32", "parallel/separate"),  # A_kk and A_qk one launch each
    (1, 130, 1, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/separate"),
    (1, 130, 1, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/bf16"),      # bf16 factors between passes
    (2, 37, 2, 16, 16, 32, (-1.0, 0.0), True, "float32", "parallel/bf16"),
    (1, 40, 2, 16, 16, 32, (-1e3, -1e2), True, "bfloat16", "blocked/bf16"),
    (1, 40, 2, 16, 16, 32, (-1e3, -1e2), True, "float32", "parallel/xla-cumsum"),  # XLA's local cumsum
    # one TF32 product per inverse step: differs from the row above only compiled (interpret runs fp32)
    (1, 130, 1, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/bf16/tf32"),
    (1, 130, 1, 32, 32, 64, (-0.1, 0.0), True, "bfloat16", "parallel/bf16/tf32"),   # weak gates: every inverse term
    (2, 37, 2, 16, 16, 16, (-30.0, 0.0), True, "bfloat16", "column/bf16"),
    # A_kk and A_qk by 16-row tiles: weak gates (tiles below the diagonal carry weight), strong ones (no
    # overflow, those tiles ~0), several key slices, one tile a chunk
    (1, 64, 3, 16, 32, 64, (-0.5, 0.0), False, "float32", "parallel/tiles"),
    (1, 40, 2, 16, 16, 32, (-1e3, -1e2), True, "float32", "parallel/tiles"),
    (1, 130, 1, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/tiles/bf16"),
    (1, 70, 1, 64, 32, 64, (-3e3, -1e-4), True, "float32", "parallel/tiles"),
    (2, 24, 2, 16, 16, 16, (-1.0, 0.0), False, "bfloat16", "parallel/tiles"),
    # the diagonal blocks one program per token with the one-launch solve: both layouts, weak and unbounded
    # gates, several chunks with a ragged tail, one sub-block a chunk
    (1, 130, 1, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/diagonal/bf16/whole"),
    (1, 64, 3, 16, 32, 64, (-0.5, 0.0), False, "float32", "parallel/diagonal/chunked/whole"),
    (1, 40, 2, 16, 16, 32, (-1e3, -1e2), True, "float32", "parallel/diagonal/whole"),
    (1, 70, 1, 64, 32, 64, (-3e3, -1e-4), True, "float32", "parallel/diagonal/chunked/whole"),
    (2, 24, 2, 16, 16, 16, (-1.0, 0.0), False, "bfloat16", "parallel/diagonal/whole"),
    # the sliced solve with the levels across sub-blocks and the doubling inverse in the pairs launch (the default
    # before run 27)
    (1, 130, 2, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/across-levels/bf16"),
    (1, 64, 3, 16, 32, 64, (-0.5, 0.0), False, "float32", "parallel/across-levels/chunked"),
    (1, 70, 1, 64, 32, 64, (-3e3, -1e-4), True, "float32", "parallel/across-levels"),
    # every level in one launch (the default before the diagonal form), with either solve: K != V both ways
    (1, 130, 1, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/joint/bf16/whole"),
    (1, 130, 1, 32, 32, 64, (-0.1, 0.0), True, "bfloat16", "parallel/joint/bf16/sliced"),
    (1, 64, 3, 16, 32, 64, (-0.5, 0.0), False, "float32", "parallel/joint/chunked/whole"),
    (1, 40, 2, 32, 16, 32, (-1e3, -1e2), True, "float32", "parallel/joint/sliced"),
    (2, 37, 2, 16, 16, 32, (-1.0, 0.0), True, "float32", "parallel/joint/bf16"),
    (1, 70, 1, 64, 32, 64, (-3e3, -1e-4), True, "float32", "parallel/joint"),
    (1, 70, 4, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/dh2/bf16"),   # two heads a program, set
    (1, 130, 2, 64, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/fs16/factors-programs"),   # W, U, ...: 4 / 2
    # programs a chunk
    # the local cumulative decay written by the per-token launch: both layouts, unbounded gates, one sub-block a chunk
    (1, 130, 2, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/diagonal-cumsum"),
    (1, 130, 2, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/pallas-cumsum"),   # its own launch
    (1, 40, 2, 16, 16, 32, (-1e3, -1e2), True, "float32", "parallel/diagonal-cumsum/chunked"),
    (2, 24, 2, 16, 16, 16, (-1.0, 0.0), False, "bfloat16", "parallel/diagonal-cumsum"),
    # the pairs across sub-blocks and the inverse by 16 x 16 tiles, named (the default since run 27, so also every
    # "parallel" row above without across-levels; with the 4 / 2 / 1 sub-blocks a chunk, unbounded gates and ragged
    # tails there): bf16 factors, one TF32 product a step with weak gates, the chunked layout
    (1, 130, 2, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/across-tiles/bf16"),
    (1, 130, 1, 32, 32, 64, (-0.1, 0.0), True, "bfloat16", "parallel/across-tiles/bf16/tf32"),
    (1, 64, 3, 16, 32, 64, (-0.5, 0.0), False, "float32", "parallel/across-tiles/chunked"),
    # W, U, ... one program a chunk walking 16-column slices in a loop (the default form): K == V (no branches) and
    # K != V
    (1, 130, 2, 64, 64, 64, (-3.0, 0.0), True, "bfloat16", "parallel/fs16"),
    (1, 70, 1, 64, 32, 64, (-3e3, -1e-4), True, "float32", "parallel/fs16/across-tiles"),
    # the per-token walk's exponentials as e^x (2^x, the default since run 28, in every row above): weak and
    # unbounded gates, both layouts, the cumsum it writes; a warp a head (dh2)
    (1, 130, 2, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/exp-e/bf16"),
    (1, 70, 1, 64, 32, 64, (-3e3, -1e-4), True, "float32", "parallel/exp-e/chunked"),
    (2, 24, 2, 16, 16, 16, (-1.0, 0.0), False, "bfloat16", "parallel/exp-e/dh2"),
    # the tile pairs launch (`across="tiles"`): its decays as 2^x and its products across sub-blocks in one loop for
    # every block pair are the defaults since run 31 (so in the rows above that run it); "pairs-exp-e" takes e^x,
    # "pairs-per-block"
    # a loop per row block: weak and unbounded gates (the ratios between sub-blocks then underflow), bf16 and fp32
    # factors, the chunked layout, ragged tails, 2 sub-blocks a chunk (one pair) and 4
    (1, 130, 2, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/pairs-per-block/bf16"),
    (1, 70, 1, 64, 32, 64, (-3e3, -1e-4), True, "float32", "parallel/pairs-per-block/chunked"),
    (1, 64, 3, 16, 32, 64, (-0.5, 0.0), False, "float32", "parallel/pairs-per-block"),
    (1, 130, 2, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/pairs-exp-e/bf16"),
    (1, 70, 1, 64, 32, 64, (-3e3, -1e-4), True, "float32", "parallel/pairs-exp-e/pairs-per-block/chunked"),
    (2, 37, 2, 16, 16, 32, (-1.0, 0.0), True, "bfloat16", "parallel/pairs-exp-e/pairs-per-block/bf16"),
    (2, 37, 2, 16, 16, 32, (-1.0, 0.0), True, "bfloat16", "parallel/bf16"),
    # q e^G written by the pairs launch (`qg_in_pairs`), the loop and exponential forms at 4, 2 and 1 sub-blocks a
    # chunk with weak gates (e^G of every row block well above 0), unbounded gates, ragged tails, the chunked layout
    (1, 130, 2, 32, 32, 64, (-3.0, 0.0), True, "bfloat16", "parallel/qg-in-pairs/pairs-exp-e/pairs-per-block/bf16"),
    (1, 130, 2, 32, 32, 64, (-0.5, 0.0), True, "float32", "parallel/qg-in-pairs/pairs-exp-e"),
    (1, 70, 1, 64, 32, 64, (-3e3, -1e-4), True, "float32", "parallel/qg-in-pairs/pairs-exp-e/chunked"),
    (2, 37, 2, 16, 16, 32, (-1.0, 0.0), True, "bfloat16", "parallel/qg-in-pairs/pairs-per-block/bf16"),
    (2, 37, 2, 16, 16, 32, (-1.0, 0.0), True, "float32", "parallel/qg-in-pairs"),
    (2, 24, 2, 16, 16, 16, (-1.0, 0.0), False, "float32", "parallel/qg-in-pairs/pairs-exp-e/pairs-per-block"),
    (2, 24, 2, 16, 16, 16, (-1.0, 0.0), False, "float32", "parallel/qg-in-pairs"),
]


def _chunk_row_features(b, t, h, kd, vd, chunk, gates, init, dtype, intra):
    form, *options = intra.split("/")
    return [("form", form), *(("option", o) for o in options), ("shape", (b, t, h, kd, vd, chunk)),
            ("gates", gates), ("dtype", dtype, init), *(("sub-blocks", o, chunk // 16) for o in (form, *options))]


# In interpret mode: every row of the default form ("parallel" alone), and each other row that brings a form, an
# option, a form or option at a number of 16-row sub-blocks a chunk, a shape, a gate range or a dtype no earlier row
# did (kernel_matrix).
@pytest.mark.parametrize("b,t,h,kd,vd,chunk,gates,init,dtype,intra", covering_rows(
    CHUNK_ROWS, _chunk_row_features, keep=lambda *row: row[-1] == "parallel"))
def test_chunk_kernel_matches_recurrent_reference(rng, interpret, b, t, h, kd, vd, chunk, gates, init, dtype, intra):
    q = _l2(rng.standard_normal((b, t, h, kd)))
    k = _l2(rng.standard_normal((b, t, h, kd)))
    v = rng.standard_normal((b, t, h, vd))
    g = rng.uniform(*gates, (b, t, h, kd)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
    s0 = rng.standard_normal((b, h, kd, vd)).astype(np.float32) if init else None
    cast = lambda x: jnp.asarray(x, dtype)
    intra, *options = intra.split("/")   # "separate": A_kk, A_qk one launch each; "tiles": by 16-row tiles;
    # "joint": every level in one launch; "diagonal" (the default): the diagonal blocks per token; "whole" /
    # "sliced": the solve's form (default: sliced where the pairs allow); "bf16": bf16 factors; "chunked": XLA's
    # layout copies; "dh2": two heads and two warps a program of the per-token launch (default: auto, one warp);
    # "exp-e": the per-token walk in e^x (default: 2^x); "pairs-exp-e": the tile pairs launch's decays in e^x
    # (default: 2^x); "pairs-per-block": its products in a loop per row block (default: one loop); "qg-in-pairs":
    # q e^G written by it
    factors = "bfloat16" if "bf16" in options else "float32"
    o, s = kda_chunk_pallas(cast(q), cast(k), cast(v), g, beta, initial_state=s0,
                            blocks=ChunkBlocks(chunk=chunk, value_block=16, intra=intra, factors=factors,
                                               cumsum=next((c for c in ("xla", "pallas", "diagonal")
                                                            if c + "-cumsum" in options), "auto"),
                                               inverse="tf32" if "tf32" in options else "tf32x3",
                                               pairs=next((p for p in ("separate", "tiles", "joint", "diagonal")
                                                           if p in options), ChunkBlocks.pairs),
                                               layout="chunked" if "chunked" in options else "tokens",
                                               solve=next((p for p in ("sliced", "whole") if p in options),
                                                          "auto"),
                                               diagonal_heads=2 if "dh2" in options else 0,
                                               diagonal_num_warps=2 if "dh2" in options else 0,
                                               factors_slice=16 if "fs16" in options else ChunkBlocks.factors_slice,
                                               across=next((a for a in ("tiles", "levels")
                                                            if "across-" + a in options), "auto"),
                                               factors_loop="factors-programs" not in options,
                                               diagonal_exp2="exp-e" not in options,
                                               pairs_exp2="pairs-exp-e" not in options,
                                               pairs_one_loop="pairs-per-block" not in options,
                                               qg_in_pairs="qg-in-pairs" in options,
                                               key_slice=32 if kd >= 64 else 16), interpret=interpret)
    f32 = lambda x: np.asarray(cast(x), np.float32)
    o_ref, s_ref = kda_recurrent_reference(f32(q), f32(k), f32(v), g, beta, initial_state=s0)
    assert o.dtype == jnp.dtype(dtype) and o.shape == (b, t, h, vd)
    inner = "bfloat16" if factors == "bfloat16" else dtype
    assert_close("o", o, o_ref, dtype=kernel_dtype(inner, interpret))
    assert_close("state", s, s_ref, tol=TOLERANCES[kernel_dtype(factors, interpret)])
    assert np.all(np.asarray(o, np.float32) != 0) or gates[1] <= -1e2  # every element written


@pytest.mark.parametrize("b,h,kd,a_shape", [(1, 2, 16, None), (3, 4, 32, (4, 1)), (2, 3, 16, (1, 16))])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_decode_kernel_matches_xla_twin(rng, interpret, b, h, kd, a_shape, lower_bound):
    inputs, weights, conv, state = decode_inputs(rng, b, h, kd, lower_bound=lower_bound, a_shape=a_shape)
    out_r, conv_r, state_r = kda_decode_xla(inputs, weights, conv, state)
    out, new_conv, new_state = kda_decode_pallas(inputs, weights, conv, state, interpret=interpret)
    assert_close("out", out, out_r, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(new_conv, np.float32), np.asarray(conv_r, np.float32))
    assert_close("state", new_state, state_r, dtype=kernel_dtype("float32", interpret))
    assert np.all(np.asarray(out, np.float32) != 0)


@pytest.mark.parametrize("b,h,kd,splits,a_shape,state_dtype", [
    (1, 2, 32, 2, None, "float32"), (2, 3, 64, 4, (3, 1), "float32"), (1, 2, 64, 0, (1, 64), "bfloat16")])
def test_decode_split_into_column_blocks_matches_xla_twin(rng, interpret, b, h, kd, splits, a_shape, state_dtype):
    """Each head's state cut into column blocks, one program each (0: the auto rule, which splits
    2 heads in two from 2 rows x heads), the output norm after the kernel."""
    inputs, weights, conv, state = decode_inputs(rng, b, h, kd, lower_bound=-5.0 if splits == 4 else None,
                                                  a_shape=a_shape)
    state = state.astype(state_dtype)
    blocks = DecodeBlocks(value_blocks=splits, split_from=2)
    assert blocks.value_blocks_for(b, h, kd) == (splits or 2)
    out_r, conv_r, state_r = kda_decode_xla(inputs, weights, conv, state)
    out, new_conv, new_state = kda_decode_pallas(inputs, weights, conv, state, blocks=blocks, interpret=interpret)
    assert_close("out", out, out_r, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(new_conv, np.float32), np.asarray(conv_r, np.float32))
    assert new_state.dtype == state_r.dtype
    assert_close("state", new_state, state_r, dtype=kernel_dtype(state_dtype, interpret))


@pytest.mark.parametrize("b,h,kd,column_block,a_shape,state_dtype,lower_bound", [
    (1, 2, 32, 16, None, "float32", None), (2, 3, 64, 16, (3, 1), "float32", -5.0),
    (1, 2, 64, 32, (1, 64), "bfloat16", None),
    (2, 2, 32, 32, None, "float32", None)])   # column_block == V: the whole-state kernel
def test_decode_column_loop_matches_whole_state_kernel_and_twin(rng, interpret, b, h, kd, column_block, a_shape,
                                                                state_dtype, lower_bound):
    """The one-token kernel walking the state in column blocks (one program per head, the output norm
    inside) gives the whole-state kernel's outputs, conv window and state, and the XLA twin's."""
    inputs, weights, conv, state = decode_inputs(rng, b, h, kd, lower_bound=lower_bound, a_shape=a_shape)
    state = state.astype(state_dtype)
    out_r, conv_r, state_r = kda_decode_xla(inputs, weights, conv, state)
    whole = kda_decode_pallas(inputs, weights, conv, state, interpret=interpret)
    looped = kda_decode_pallas(inputs, weights, conv, state, interpret=interpret,
                               blocks=DecodeBlocks(column_block=column_block))
    for name, got, want in zip(("out", "conv", "state"), looped, whole):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_close(f"loop vs whole {name}", got, want, dtype=kernel_dtype(state_dtype, interpret))
    assert_close("out", looped[0], out_r, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(looped[1], np.float32), np.asarray(conv_r, np.float32))
    assert_close("state", looped[2], state_r, dtype=kernel_dtype(state_dtype, interpret))
    with pytest.raises(ValueError, match=f"column_block=128 does not divide V={kd}"):
        kda_decode_pallas(inputs, weights, conv, state, interpret=interpret, blocks=DecodeBlocks(column_block=128))


def test_decode_blocks_name_a_bad_split():
    with pytest.raises(ValueError, match="value_blocks must be 0"):
        DecodeBlocks(value_blocks=3)
    for bad in (-1, True, 2.0, 8, 24):
        with pytest.raises(ValueError, match="column_block must be 0"):
            DecodeBlocks(column_block=bad)
    with pytest.raises(ValueError, match="does not combine with value_blocks=2"):
        DecodeBlocks(column_block=32, value_blocks=2)
    whole_state = "num_warps=8 with one program over a head's whole state"
    for settings in ({}, {"value_blocks": 1}):
        with pytest.raises(ValueError, match=whole_state):
            DecodeBlocks(num_warps=8, **settings)
    assert DecodeBlocks(num_warps=8, value_blocks=2).value_blocks_for(1, 32, 128) == 2
    auto = DecodeBlocks(num_warps=8, split_from=1024)      # auto: two blocks from 1,024 rows x heads on
    assert auto.value_blocks_for(64, 32, 128) == 2
    with pytest.raises(ValueError, match=whole_state):
        auto.value_blocks_for(1, 32, 128)
    with pytest.raises(ValueError, match="value_blocks=8 does not split V=64"):
        DecodeBlocks(value_blocks=8).value_blocks_for(1, 2, 64)
    assert DecodeBlocks().value_blocks_for(1, 32, 128) == 1 and DecodeBlocks().value_blocks_for(256, 32, 128) == 1
    assert DecodeBlocks(split_from=1024).value_blocks_for(64, 32, 128) == 2


def test_bf16_state_is_read_and_written_in_bf16(rng, interpret):
    """A bf16 recurrent state: the kernel and its twin keep it bf16 (the math in fp32, the new state
    rounded once), and one step from it equals the fp32 step from the same (rounded) state."""
    inputs, weights, conv, state = decode_inputs(rng, 2, 3, 32)
    state16 = state.astype(jnp.bfloat16)
    out_r, _, state_r = kda_decode_xla(inputs, weights, conv, state16)
    out, _, new_state = kda_decode_pallas(inputs, weights, conv, state16, interpret=interpret)
    assert new_state.dtype == state_r.dtype == jnp.bfloat16
    assert_close("out", out, out_r, dtype="bfloat16")
    assert_close("state", new_state, state_r, dtype="bfloat16")
    out32, _, state32 = kda_decode_xla(inputs, weights, conv, state16.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(out_r, np.float32), np.asarray(out32, np.float32))
    np.testing.assert_array_equal(np.asarray(state_r), np.asarray(state32.astype(jnp.bfloat16)))


def test_decode_step_agrees_with_the_recurrence(rng):
    """The fused step's recurrence part is the same delta rule as the sequence reference."""
    b, h, kd = 2, 2, 16
    inputs, weights, conv, state = decode_inputs(rng, b, h, kd, dtype=jnp.float32)
    conv = jnp.zeros_like(conv)
    identity = jnp.zeros_like(weights.q_conv).at[-1].set(1.0)  # conv = identity
    weights = KDADecodeWeights(q_conv=identity, k_conv=identity, v_conv=identity, dt_bias=weights.dt_bias,
                               a_log=weights.a_log, o_norm_w=weights.o_norm_w)
    _, _, new_state = kda_decode_xla(inputs, weights, conv, state)
    x = np.asarray(inputs.x_qkv)
    silu = lambda z: z / (1 + np.exp(-z))
    q, k, v = (silu(x[:, i]) for i in range(3))
    u = np.asarray(inputs.f) + np.asarray(weights.dt_bias)
    g = -np.exp(np.asarray(weights.a_log)) * np.logaddexp(0, u)
    beta = 1 / (1 + np.exp(-np.asarray(inputs.beta_logit)))
    _, s_ref = kda_recurrent_reference(_l2(q)[:, None], _l2(k)[:, None], v[:, None], g[:, None], beta[:, None],
                                       initial_state=state)
    assert_close("state", new_state, s_ref)


def test_decode_names_the_bad_argument(rng):
    inputs, weights, conv, state = decode_inputs(rng, 2, 2, 16)
    with pytest.raises(ValueError, match=r"state must have shape \(2, 2, 16, 16\)"):
        kda_decode_xla(inputs, weights, conv, state[:, :, :8])


@pytest.mark.parametrize("intra,inter", [("blocked", "fused"), ("parallel", "fused"), ("blocked", "split")])
def test_chunk_kernels_lower_for_cuda_at_the_48b_shape(triton_for_hopper, intra, inter):
    """The kernels lower to Triton for sm_90 at Kimi-Linear's head shape (K = V = 128, chunk 64)
    on any host (the GPU run compiles and checks them)."""
    import jax

    b, t, h, kd = 1, 256, 4, 128
    spec = jax.ShapeDtypeStruct
    args = (spec((b, t, h, kd), jnp.bfloat16),) * 3 + (spec((b, t, h, kd), jnp.float32), spec((b, t, h), jnp.float32))
    blocks = ChunkBlocks(intra=intra, inter=inter)
    call = jax.jit(lambda q, k, v, g, beta: kda_chunk_pallas(q, k, v, g, beta, blocks=blocks, interpret=False))
    module = jax.export.export(call, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    # parallel: the diagonal blocks per token (with the local cumsum), the levels across sub-blocks with the
    # inverse, then W, U, ... by key slices; split: the state pass and the outputs
    launches = {"blocked": 1, "parallel": 3}[intra] + {"fused": 1, "split": 2}[inter]
    assert module.mlir_module().count("__gpu$xla.gpu.triton") == launches


@pytest.mark.parametrize("b,t,h,kd,vd,chunk,gates,intra", [
    (2, 37, 2, 16, 32, 32, (-1.0, 0.0), "blocked"),      # T off the chunk, two value blocks
    (1, 130, 1, 32, 32, 64, (-1e3, -1e2), "parallel"),   # unbounded gates, three chunks
])
def test_split_sequential_pass_matches_recurrent_reference(rng, interpret, b, t, h, kd, vd, chunk, gates, intra):
    """inter="split": the state-only pass and the parallel outputs give the fused pass's result."""
    q = _l2(rng.standard_normal((b, t, h, kd))).astype(np.float32)
    k = _l2(rng.standard_normal((b, t, h, kd))).astype(np.float32)
    v = rng.standard_normal((b, t, h, vd)).astype(np.float32)
    g = rng.uniform(*gates, (b, t, h, kd)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
    s0 = rng.standard_normal((b, h, kd, vd)).astype(np.float32)
    o, s = kda_chunk_pallas(q, k, v, g, beta, initial_state=s0, interpret=interpret,
                            blocks=ChunkBlocks(chunk=chunk, value_block=16, intra=intra, key_slice=16, inter="split"))
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, initial_state=s0)
    assert_close("o", o, o_ref, dtype=kernel_dtype("float32", interpret))
    assert_close("state", s, s_ref, tol=TOLERANCES[kernel_dtype("float32", interpret)])


@pytest.mark.parametrize("blocks,message", [
    (ChunkBlocks(intra="rows"), "intra must be"),
    (ChunkBlocks(inter="rows"), "inter must be"),
    (ChunkBlocks(intra="parallel", key_slice=24), "key_slice must be a power of two >= 16"),
    (ChunkBlocks(intra="parallel", key_slice=8), "key_slice must be a power of two >= 16"),
    (ChunkBlocks(intra="parallel", chunk=8), "must be powers of two"),
    (ChunkBlocks(intra="parallel", chunk=128), "at most 64 tokens"),
    (ChunkBlocks(intra="parallel", pairs="rows"), "pairs must be"),
    (ChunkBlocks(intra="parallel", pairs="tiles", pairs_num_warps=3), "pairs_num_warps must be"),
    (ChunkBlocks(factors="float16"), "factors must be"),
    (ChunkBlocks(intra="parallel", cumsum="scan"), "cumsum must be"),
    (ChunkBlocks(intra="parallel", inverse="fp32"), "inverse must be"),
    (ChunkBlocks(factors="bfloat16", inter="split"), "needs inter='fused'"),
    (ChunkBlocks(layout="heads"), "layout must be"),
    (ChunkBlocks(inter_num_stages=-1), "inter_num_stages must be"),
    (ChunkBlocks(solve="rows"), "solve must be"),
    (ChunkBlocks(pairs="tiles", solve="sliced"), "takes the inverse from"),
    (ChunkBlocks(pairs="diagonal", diagonal_heads=3), "diagonal_heads must be"),
    (ChunkBlocks(pairs="diagonal", diagonal_heads=16), "diagonal_heads must be"),
    (ChunkBlocks(pairs="diagonal", diagonal_heads=2.0), "diagonal_heads must be"),
    (ChunkBlocks(pairs="diagonal", diagonal_num_warps=2.0), "diagonal_num_warps must be"),
    (ChunkBlocks(pairs="diagonal", diagonal_num_warps=3), "diagonal_num_warps must be"),
    (ChunkBlocks(pairs="diagonal", diagonal_heads=2), "H=1 is not a multiple of 2"),
    (ChunkBlocks(pairs="joint", cumsum="diagonal"), "cumsum='diagonal' is written by"),
    (ChunkBlocks(cumsum="scan"), "cumsum must be 'auto', 'xla', 'pallas' or 'diagonal'"),
    (ChunkBlocks(diagonal_band=1), "diagonal_band must be True or False"),
    (ChunkBlocks(qk_norm="pallas"), "qk_norm must be"),
    (ChunkBlocks(qk_norm="diagonal-after", diagonal_band=False), "needs diagonal_band=True"),
    (ChunkBlocks(factors_slice=48), "factors_slice must be 0"),
    (ChunkBlocks(factors_slice=8), "factors_slice must be 0"),
    (ChunkBlocks(factors_num_warps=3), "factors_num_warps must be"),
    (ChunkBlocks(across="blocks"), "across must be 'auto', 'levels' or 'tiles'"),
    (ChunkBlocks(pairs_key_slice=24), "pairs_key_slice must be 0"),
    (ChunkBlocks(factors_loop=1), "factors_loop must be True or False"),
    (ChunkBlocks(diagonal_exp2=1), "diagonal_exp2 must be True or False"),
    (ChunkBlocks(pairs_exp2=1), "pairs_exp2 must be True or False"),
    (ChunkBlocks(pairs_one_loop="yes"), "pairs_one_loop must be True or False"),
    (ChunkBlocks(qg_in_pairs=1), "qg_in_pairs must be True or False"),
    (ChunkBlocks(across="levels", qg_in_pairs=True), "qg_in_pairs is a setting of the across='tiles' launch"),
    (ChunkBlocks(qg_in_pairs=True, qk_norm="scales"), "qg_in_pairs does not combine with qk_norm='scales'"),
    (ChunkBlocks(pairs_num_stages=-1), "pairs_num_stages must be 0"),
    (ChunkBlocks(factors_num_stages=2.0), "factors_num_stages must be 0"),
    (ChunkBlocks(across="tiles", solve="whole"), "across='tiles' follows the per-token launch"),
    (ChunkBlocks(across="tiles", pairs="joint"), "across='tiles' follows the per-token launch"),
])
def test_chunk_blocks_name_the_bad_setting(rng, blocks, message):
    q = jnp.asarray(_l2(rng.standard_normal((1, 16, 1, 16))), jnp.float32)
    g = jnp.asarray(rng.uniform(-1, 0, (1, 16, 1, 16)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (1, 16, 1)), jnp.float32)
    with pytest.raises(ValueError, match=message):
        kda_chunk_pallas(q, q, q, g, beta, blocks=blocks, interpret=True)


def test_chunk_blocks_auto_settles_by_chunk_and_dtype():
    """"auto" fields: the parallel form up to 64-token chunks, bf16 factors (and one TF32 product per
    inverse step) for bf16 values only, fp32 factors for the split pass."""
    bf16, fp32 = ChunkBlocks().resolve("bfloat16"), ChunkBlocks().resolve("float32")
    assert (bf16.intra, bf16.factors, bf16.inverse, bf16.solve, bf16.cumsum) == ("parallel", "bfloat16", "tf32",
                                                                                 "sliced", "diagonal")
    assert (fp32.intra, fp32.factors, fp32.inverse, fp32.solve) == ("parallel", "float32", "tf32x3", "sliced")
    assert ChunkBlocks(pairs="tiles").resolve("bfloat16").solve == "whole"     # no inverse in the tiles launch
    assert bf16.across == fp32.across == "tiles" and bf16.pairs_launch() == (1, 3, 16)
    for form in (dict(pairs="joint"), dict(solve="whole"), dict(chunk=128)):    # no tile solve after the per-token
        levels = ChunkBlocks(**form).resolve("bfloat16")                        # launch: the levels, 4 warps
        assert levels.across == "levels" and levels.pairs_launch() == (4, 1, 32)
    assert ChunkBlocks(pairs_num_warps=2, pairs_num_stages=1, pairs_key_slice=32).resolve(
        "bfloat16").pairs_launch() == (2, 1, 32)
    with pytest.raises(ValueError, match="across is 'auto'"):
        ChunkBlocks().pairs_launch()
    assert ChunkBlocks().resolve("bfloat16").factors_launch() == (8, 3)         # the W, U loop's loads in 3 stages
    assert ChunkBlocks().resolve("float32").factors_launch() == (8, 2)          # ... 2 with fp32 factors
    with pytest.raises(ValueError, match="factors is 'auto'"):
        ChunkBlocks().factors_launch()
    assert ChunkBlocks(factors_loop=False).factors_launch() == (8, 1)           # a program a slice: num_stages
    assert ChunkBlocks(factors_num_warps=0, factors_num_stages=3).factors_launch() == (4, 3)
    assert ChunkBlocks(pairs="joint").resolve("bfloat16").cumsum == "pallas"   # no per-token launch to write it
    assert ChunkBlocks(chunk=128).resolve("bfloat16").cumsum == "pallas"
    assert ChunkBlocks().diagonal_launch(32, tokens=True) == (2, 1)           # two heads a program, one warp
    assert ChunkBlocks(diagonal_heads=4).diagonal_launch(32, tokens=True) == (4, 2)   # a warp for two heads
    assert ChunkBlocks(diagonal_heads=1).diagonal_launch(32, tokens=True) == (1, 1)
    assert ChunkBlocks().resolve("bfloat16").qk_norm == "diagonal-bf16"   # q, k handed on in the values' dtype
    assert ChunkBlocks().resolve("float32").qk_norm == "diagonal"
    assert ChunkBlocks().diagonal_launch(3, tokens=True) == ChunkBlocks().diagonal_launch(32, tokens=False) == (1, 1)
    assert ChunkBlocks(diagonal_heads=4, diagonal_num_warps=2).diagonal_launch(32, tokens=True) == (4, 2)
    assert ChunkBlocks(diagonal_heads=4).diagonal_launch(32, tokens=False) == (1, 1)   # chunked: a head a program
    assert ChunkBlocks(chunk=128).resolve("bfloat16").intra == "blocked"
    assert ChunkBlocks(inter="split").resolve("bfloat16").factors == "float32"
    explicit = ChunkBlocks(intra="column", factors="float32", inverse="tf32", solve="whole", cumsum="xla",
                           across="levels", qk_norm="diagonal")
    assert explicit.resolve("bfloat16") == explicit      # settings given are kept


def test_sequential_pass_pipelines_its_loads_when_its_grid_is_one_wave():
    """inter_num_stages=0 (auto): up to ONE_WAVE_STAGES while the sequential pass has at most one program per
    multiprocessor and the stages' loads fit STAGE_SHARED_BYTES, num_stages otherwise; an explicit count
    always wins."""
    auto = ChunkBlocks()
    elements = 3 * 64 * 128 + 64 * 32 + 64 * 64      # one 64-token chunk's loads, K = V = 128, 32 state columns
    bf16_stage, fp32_stage = 2 * elements + 512, 4 * elements + 512
    assert auto.sequential_stages(132, 132, bf16_stage) == ONE_WAVE_STAGES > auto.num_stages
    assert auto.sequential_stages(133, 132, bf16_stage) == auto.num_stages
    assert auto.sequential_stages(128, 132, fp32_stage) == auto.num_stages      # 2 x 120 KB would not fit
    assert 2 * fp32_stage > STAGE_SHARED_BYTES >= ONE_WAVE_STAGES * bf16_stage
    assert auto.sequential_stages(128, 132, STAGE_SHARED_BYTES // 2) == 2
    assert ChunkBlocks(inter_num_stages=2).sequential_stages(384, 132, fp32_stage) == 2


PAIR_AND_SOLVE_FORMS = [dict(pairs="tiles"), dict(pairs="diagonal", solve="whole"),
                        dict(pairs="diagonal", solve="sliced"), dict(pairs="joint", solve="sliced"),
                        dict(solve="sliced", factors_slice=16, factors_num_warps=2,   # 2 programs
                             factors_loop=False),
                        dict(pairs="diagonal", diagonal_band=False),
                        dict(across="tiles"), dict(across="tiles", diagonal_band=False),
                        dict(across="levels"), dict(across="levels", factors_loop=False),
                        dict(factors_loop=True, factors_slice=16),    # 2 key, 1 value slice in a loop
                        dict(factors_loop=True, factors_slice=16, factors_num_stages=2,
                             across="tiles", pairs_num_warps=1, pairs_num_stages=3)]


# In interpret mode: every form at 64-token chunks, and 32-token chunks once (kernel_matrix).
@pytest.mark.parametrize("chunk,form", covering_rows(
    [(chunk, form) for chunk in (64, 32) for form in PAIR_AND_SOLVE_FORMS],
    lambda chunk, form: [("chunk", chunk), ("form", tuple(sorted(form.items())))]))
def test_pair_and_solve_forms_equal_joint_pairs(rng, interpret, chunk, form):
    """Each pairs / solve form gives the joint pairs' six outputs after the one-launch solve (W, U, A_qk
    with its zero upper half, q e^G, k e^(G_C - G), e^(G_C)) to fp32 rounding, with gates weak enough that
    every tile below the diagonal carries weight."""
    from pallas_kernels.kda.chunk import chunk_intra, to_chunks
    b, t, h, kd, vd = 2, 2 * chunk, 2, 32, 16
    q, k = (_l2(rng.standard_normal((b, t, h, kd))) for _ in range(2))
    v = rng.standard_normal((b, t, h, vd))
    g = rng.uniform(-0.1, 0.0, (b, t, h, kd))
    beta = rng.uniform(0.2, 1.0, (b, t, h))
    parts = [to_chunks(jnp.asarray(x, jnp.float32), chunk) for x in (q, k, v, g, beta)]
    run = lambda **kw: chunk_intra(*parts, scale=kd ** -0.5, interpret=interpret, blocks=ChunkBlocks(
        chunk=chunk, key_slice=16, value_block=16, factors="float32", inverse="tf32x3", **kw).resolve("float32"))
    formed, reference = run(**form), run(pairs="joint", solve="whole")
    for name, a, e in zip(("w", "u", "aqk", "qg", "kt", "dec"), formed, reference):
        assert_close(name, a, e, dtype=kernel_dtype("float32", interpret))
    aqk = np.asarray(formed[2])
    assert np.all(np.triu(aqk, 1) == 0) and np.all(np.abs(np.tril(aqk, -17)).sum((-1, -2)) > 0)


@pytest.mark.parametrize("gates", [(-1.0, 0.0), (-1e3, -1e2)])
def test_diagonal_launch_writes_the_local_cumsum(rng, interpret, gates):
    """The per-token launch's running sum, read at its end, is the decay summed inside each 16-row
    sub-block (`local_cumsum`, a forward cumulative sum), in both layouts; its diagonal blocks are the
    same with and without that output, with two heads a program as with one, and with the walk's decay carried
    in base-2 units (to fp32 rounding)."""
    from pallas_kernels.kda.chunk import to_chunk_rows, to_chunks
    from pallas_kernels.kda.intra_diagonal import diagonal_pairs
    from pallas_kernels.kda.intra_parallel import local_cumsum
    b, t, h, kd, c = 1, 128, 2, 32, 64
    q, k = (jnp.asarray(_l2(rng.standard_normal((b, t, h, kd))), jnp.float32) for _ in range(2))
    g = jnp.asarray(rng.uniform(*gates, (b, t, h, kd)), jnp.float32)
    expected = local_cumsum(to_chunks(g, c))
    run = lambda split, tokens, cumsum, heads=1, band=False, exp2=False: diagonal_pairs(
        *(split(x, c) for x in (q, k, g)), scale=0.5, tokens=tokens, heads=heads, num_warps=heads,
        interpret=interpret, cumsum=cumsum, band=band, exp2=exp2)
    one_head = run(to_chunks, False, True)
    for got, want in zip(run(to_chunk_rows, True, True, heads=2), one_head):   # two heads a program, tokens layout
        assert_close("two heads a program", got, want, dtype=kernel_dtype("float32", interpret))
    for got, want in zip(run(to_chunks, False, True, exp2=True), one_head):   # the walk's decay in base-2 units
        assert_close("2^x walk", got, want, dtype=kernel_dtype("float32", interpret))
    for split, tokens in ((to_chunks, False), (to_chunk_rows, True)):
        akk, aqk, local = run(split, tokens, True)
        assert_close("local cumsum", local, expected, dtype=kernel_dtype("float32", interpret))
        akk_only, aqk_only = run(split, tokens, False)
        np.testing.assert_array_equal(np.asarray(akk), np.asarray(akk_only))
        np.testing.assert_array_equal(np.asarray(aqk), np.asarray(aqk_only))
        for band, rows in zip(run(split, tokens, True, band=True), (akk, aqk, local)):   # only the diagonal blocks
            band, rows = np.asarray(band), np.asarray(rows)
            if band.shape == rows.shape:
                np.testing.assert_array_equal(band, rows)       # the local cumsum
                continue
            assert band.shape == rows.shape[:-1] + (16,)
            blocks = rows.reshape(*rows.shape[:-2], c // 16, 16, c // 16, 16)
            inside = np.stack([blocks[..., i, :, i, :] for i in range(c // 16)], axis=-3)
            np.testing.assert_array_equal(band, inside.reshape(band.shape))
            assert np.abs(band).sum() > 0


NORMALISED_ROWS = [
    ("bfloat16", ChunkBlocks()),                                   # inside the per-token launch, tokens layout
    ("float32", ChunkBlocks(layout="chunked", diagonal_band=False)),   # ... chunked layout, whole rows
    ("bfloat16", ChunkBlocks(diagonal_heads=1, cumsum="pallas")),
    ("bfloat16", ChunkBlocks(pairs="joint")),                      # no per-token launch: XLA's norm first
    ("bfloat16", ChunkBlocks(qk_norm="xla")),
    ("bfloat16", ChunkBlocks(qk_norm="diagonal")),                 # written for the later launches in fp32
    ("float32", ChunkBlocks(qk_norm="diagonal-bf16")),             # ... or in bf16 whatever the values' dtype
    ("bfloat16", ChunkBlocks(qk_norm="diagonal-after")),           # the band scaled by 1 / |k_j| at the end
    ("float32", ChunkBlocks(qk_norm="diagonal-after", layout="chunked")),
    ("bfloat16", ChunkBlocks(qk_norm="scales")),                   # only 1 / |q|, 1 / |k| handed on
    ("bfloat16", ChunkBlocks(qk_norm="scales-after")),
    ("float32", ChunkBlocks(qk_norm="scales-after", layout="chunked")),
    ("bfloat16", ChunkBlocks(qk_norm="scales", solve="whole")),    # the whole solve reads q, k normalised by XLA
    ("bfloat16", ChunkBlocks(across="levels")),                    # the levels launch: q, k normalised
    ("bfloat16", ChunkBlocks(across="levels", qk_norm="scales")),  # ... or scaled at the end of its sums
    ("float32", ChunkBlocks(across="levels", qk_norm="scales-after", layout="chunked")),
    ("bfloat16", ChunkBlocks(qg_in_pairs=True)),                   # q e^G written by the pairs launch
    ("float32", ChunkBlocks(qg_in_pairs=True, pairs_one_loop=False, layout="chunked")),
]


def _settings(blocks: ChunkBlocks) -> list[tuple]:
    """The fields set away from their defaults, as (name, value)."""
    return [(f.name, getattr(blocks, f.name)) for f in fields(blocks) if getattr(blocks, f.name) != f.default]


# In interpret mode: each row that brings a dtype, a setting, or a norm's form with a pairs launch (across) no
# earlier row did (kernel_matrix).
@pytest.mark.parametrize("dtype,blocks", covering_rows(
    NORMALISED_ROWS, lambda dtype, blocks: [("dtype", dtype), *_settings(blocks),
                                            ("norm across", blocks.qk_norm, blocks.across)]))
def test_q_and_k_normalised_in_the_call(rng, interpret, dtype, blocks):
    """normalize_qk=True takes q and k as they leave the conv (any scale, a zero row among them) and gives the
    result of the reference on q / |q| and k / |k|; where the per-token launch runs it equals the call on
    XLA-normalised q and k up to the rounding of the norm's sums."""
    from pallas_kernels.kda.gate import l2_normalize
    b, t, h, kd, vd = 1, 100, 2, 32, 32
    dt = jnp.dtype(dtype)
    q, k = (jnp.asarray(3.0 * rng.standard_normal((b, t, h, kd)), dt) for _ in range(2))
    k = k.at[0, 5, 1].set(0.0)
    v = jnp.asarray(rng.standard_normal((b, t, h, vd)), dt)
    g = jnp.asarray(rng.uniform(-1.0, 0.0, (b, t, h, kd)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (b, t, h)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, h, kd, vd)), jnp.float32)
    blocks = replace(blocks, key_slice=16, value_block=16)
    settled = blocks.resolve(dtype)
    assert settled.normalizes_qk == (blocks.pairs == "diagonal" and blocks.qk_norm != "xla"
                                     and (settled.solve == "sliced" or not blocks.qk_norm.startswith("scales")))
    call = lambda q, k, normalize: kda_chunk_pallas(q, k, v, g, beta, initial_state=s0, blocks=blocks,
                                                    interpret=interpret, normalize_qk=normalize)
    inside = settled.normalizes_qk     # the per-token launch writes q and k (or their inverse norms): two outputs more
    shapes = _launch_output_shapes(call, q, k, True)
    outputs = lambda found: sum(map(len, found.values()))
    assert outputs(shapes) == outputs(_launch_output_shapes(call, q, k, False)) + 2 * inside
    if inside:    # the per-token launch's last two: q and k (K floats a row and head), or one float a row and head
        rows = b * -(-t // blocks.chunk) * blocks.chunk * h
        per_row = 1 if settled.hands_on_norms else kd
        assert [np.prod(x) for x in shapes["kda_chunk_diagonal"][-2:]] == [rows * per_row] * 2
    o, s = call(q, k, True)
    qn, kn = l2_normalize(q), l2_normalize(k)
    o2, s2 = kda_chunk_pallas(qn, kn, v, g, beta, initial_state=s0, blocks=blocks, interpret=interpret)
    rounded = "bfloat16" if settled.qk_norm == "diagonal-bf16" else "float32"    # q, k between the launches
    assert_close("o, normalised outside", o, o2, dtype=kernel_dtype(rounded, interpret))
    assert_close("state, normalised outside", s, s2, dtype=kernel_dtype(rounded, interpret))
    o_ref, s_ref = kda_recurrent_reference(qn, kn, v.astype(jnp.float32), g, beta, initial_state=s0)
    inner = "bfloat16" if rounded == "bfloat16" else dtype
    assert_close("o", o, o_ref, dtype=kernel_dtype(inner, interpret))
    assert_close("state", s, s_ref, tol=TOLERANCES[kernel_dtype(inner, interpret)])


@pytest.mark.parametrize("one_loop", [False, True])
def test_qg_in_pairs_moves_q_e_g_between_launches(rng, interpret, one_loop):
    """With qg_in_pairs the pairs launch writes q e^G ([C, K] a chunk) and the W, U launch neither reads q nor
    writes it: one output more and one less, one input less; the result equals the default form's."""
    b, t, h, kd, vd = 1, 100, 2, 32, 32
    q, k = (jnp.asarray(3.0 * rng.standard_normal((b, t, h, kd)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, h, vd)), jnp.bfloat16)
    g = jnp.asarray(rng.uniform(-1.0, 0.0, (b, t, h, kd)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (b, t, h)), jnp.float32)
    runs = {}
    for moved in (False, True):
        blocks = ChunkBlocks(key_slice=16, value_block=16, qg_in_pairs=moved, pairs_one_loop=one_loop)
        call = lambda q, k, normalize, blocks=blocks: kda_chunk_pallas(q, k, v, g, beta, blocks=blocks,
                                                                       interpret=interpret, normalize_qk=normalize)
        runs[moved] = (_launch_output_shapes(call, q, k, True), call(q, k, True))
    (before, (o, s)), (after, (o2, s2)) = runs[False], runs[True]
    assert len(after["kda_chunk_pairs"]) == len(before["kda_chunk_pairs"]) + 1
    assert after["kda_chunk_pairs"][-1] == before["kda_chunk_factors"][2]                 # q e^G, [B, H, N, C, K]
    assert len(after["kda_chunk_factors"]) == len(before["kda_chunk_factors"]) - 1
    assert_close("o", o2, o, dtype=kernel_dtype("bfloat16", interpret))
    assert_close("state", s2, s, dtype=kernel_dtype("float32", interpret))


def _launch_output_shapes(call, q, k, normalize) -> dict[str, list[tuple]]:
    """The outputs' shapes of every Pallas launch in call(q, k, normalize)'s traced program, by launch name."""
    import jax
    found = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                name = str(eqn.params["name"])
                found.setdefault(name, []).extend(v.aval.shape for v in eqn.outvars)
            for p in eqn.params.values():
                if hasattr(getattr(p, "jaxpr", None), "eqns"):
                    walk(p.jaxpr)
    walk(jax.make_jaxpr(lambda q, k: call(q, k, normalize))(q, k).jaxpr)
    return found


def test_normalising_inside_needs_the_per_token_launch(rng):
    from pallas_kernels.kda.chunk import chunk_intra, to_chunks
    x = to_chunks(jnp.asarray(rng.standard_normal((1, 32, 1, 16)), jnp.float32), 16)
    with pytest.raises(ValueError, match="inside the per-token launch"):
        chunk_intra(x, x, x, x, x[..., 0], scale=1.0, interpret=True, normalize=True,
                    blocks=ChunkBlocks(chunk=16, pairs="joint").resolve("float32"))


# In interpret mode: each row that brings a length, a dtype, a cumsum or a pairs launch no earlier row did
# (kernel_matrix).
@pytest.mark.parametrize("t,dtype,cumsum,pairs", covering_rows([
    (200, "bfloat16", "pallas", "joint"), (128, "float32", "pallas", "joint"),
    (70, "bfloat16", "pallas", "separate"), (70, "bfloat16", "xla", "joint"), (200, "bfloat16", "pallas", "tiles"),
    (200, "bfloat16", "pallas", "diagonal"), (128, "float32", "pallas", "diagonal"),
    (200, "bfloat16", "diagonal", "diagonal"),
], lambda t, dtype, cumsum, pairs: [("t", t), ("dtype", dtype), ("cumsum", cumsum), ("pairs", pairs)]))
def test_tokens_layout_equals_chunked_layout(rng, interpret, t, dtype, cumsum, pairs):
    """layout="tokens" (the kernels read q, k, v, g, beta and write o in [B, T, H, ...]) gives the
    chunked layout's outputs bit for bit: T off the chunk (a padded tail) and on it (no copy), bf16 and
    fp32 values, an initial state, joint, separate, tiled and diagonal pair launches. With XLA's cumsum the tokens
    layout is not taken (same result)."""
    b, h, kd, vd = 2, 3, 32, 32
    dt = jnp.dtype(dtype)
    q, k = (jnp.asarray(_l2(rng.standard_normal((b, t, h, kd))), dt) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, h, vd)), dt)
    g = jnp.asarray(rng.uniform(-1.0, 0.0, (b, t, h, kd)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (b, t, h)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, h, kd, vd)), jnp.float32)
    tokens = ChunkBlocks(value_block=16, key_slice=16, cumsum=cumsum, pairs=pairs)
    chunked = ChunkBlocks(value_block=16, key_slice=16, cumsum=cumsum, pairs=pairs, layout="chunked")
    assert tokens.resolve(dtype).reads_tokens == (cumsum != "xla") and not chunked.resolve(dtype).reads_tokens
    o1, s1 = kda_chunk_pallas(q, k, v, g, beta, initial_state=s0, blocks=tokens, interpret=interpret)
    o2, s2 = kda_chunk_pallas(q, k, v, g, beta, initial_state=s0, blocks=chunked, interpret=interpret)
    assert o1.shape == (b, t, h, vd) and o1.dtype == dt
    np.testing.assert_array_equal(np.asarray(o1.astype(jnp.float32)), np.asarray(o2.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
    o_ref, s_ref = kda_recurrent_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g,
                                           beta, initial_state=s0)
    assert_close("o", o1, o_ref, dtype=kernel_dtype(dtype, interpret))
    assert_close("state", s1, s_ref, tol=TOLERANCES[kernel_dtype(dtype, interpret)])


def test_default_blocks_at_chunk_128_take_the_blocked_form(rng, interpret):
    """A 128-token chunk with the default settings runs (the blocked form) and matches the reference."""
    b, t, h, kd = 1, 140, 1, 16
    q, k = (_l2(rng.standard_normal((b, t, h, kd))).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((b, t, h, kd)).astype(np.float32)
    g = rng.uniform(-1.0, 0.0, (b, t, h, kd)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
    o, s = kda_chunk_pallas(q, k, v, g, beta, blocks=ChunkBlocks(chunk=128, value_block=16), interpret=interpret)
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta)
    assert_close("o", o, o_ref, dtype=kernel_dtype("float32", interpret))
    assert_close("state", s, s_ref, tol=TOLERANCES[kernel_dtype("float32", interpret)])


def test_chunk_passes_refuse_unsettled_blocks(rng):
    from pallas_kernels.kda.chunk import chunk_inter, chunk_intra

    x = jnp.zeros((1, 1, 1, 16, 16), jnp.float32)
    with pytest.raises(ValueError, match="'auto' fields"):
        chunk_intra(x, x, x, x, x[..., 0], scale=1.0, blocks=ChunkBlocks(), interpret=True)
    with pytest.raises(ValueError, match="'auto' fields"):
        chunk_inter(x, x, x[..., :16], x, x, x[..., 0, :], x[:, :, 0], out_dtype=jnp.float32, blocks=ChunkBlocks(),
                    interpret=True)
    # the tokens layout only where the settled blocks read it (the split pass writes the chunked layout)
    split = ChunkBlocks(inter="split").resolve("float32")
    with pytest.raises(ValueError, match="tokens layout need layout='tokens'"):
        chunk_intra(x, x, x, x, x[..., 0], scale=1.0, blocks=split, interpret=True, tokens=True)
    with pytest.raises(ValueError, match="tokens layout need layout='tokens'"):
        chunk_inter(x, x, x[..., :16], x, x, x[..., 0, :], x[:, :, 0], out_dtype=jnp.float32, blocks=split,
                    interpret=True, tokens=True)
