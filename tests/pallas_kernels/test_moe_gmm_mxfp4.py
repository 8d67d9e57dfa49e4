"""Packed MXFP4 expert weights: the JAX dequantiser against the checkpoint reader's (numpy, an
independent formulation), and the Pallas kernels that decode in registers (interpret mode on the CPU,
compiled on a GPU) against the references over the dequantised bf16 weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from tolerances import assert_close, kernel_dtype

from k3jax.checkpoint.mxfp4 import dequantize_mxfp4
from pallas_kernels.moe_gmm import (GluSpec, Mxfp4Weight, TileBlocks, grouped_glu, grouped_glu_pallas,
                                    grouped_glu_reference, grouped_matmul_pallas, grouped_matmul_reference,
                                    pair_glu, pair_glu_pallas, pair_glu_reference, pair_matmul_pallas,
                                    pair_matmul_reference)
from pallas_kernels.moe_gmm.mxfp4 import (RAW_SCALE_OFFSET, decode_e2m1, decode_e2m1_raw, dequantize,
                                          from_checkpoint_layout, raw_scale_factor, scale_factor)
from pallas_kernels.moe_gmm.mxfp4_asm import decode_e2m1_asm, decode_e2m1_bf16_asm, raw_scale_factor_asm

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="inline PTX runs in a compiled kernel on a GPU only")


def _checkpoint_tensors(rng, g, n, k):
    """Random stacked checkpoint tensors: every E2M1 code, scales around 2^0 (E8M0 115..135)."""
    packed = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    scale = rng.integers(115, 136, (g, n, k // 32), dtype=np.uint8)
    return packed, scale


def test_dequantize_equals_the_checkpoint_reader(rng):
    packed, scale = _checkpoint_tensors(rng, 3, 24, 64)
    w = from_checkpoint_layout(jnp.asarray(packed), jnp.asarray(scale))
    assert w.shape == (3, 64, 24)
    ours = np.asarray(dequantize(w, jnp.float32))
    for e in range(3):
        np.testing.assert_array_equal(ours[e], dequantize_mxfp4(packed[e], scale[e]).T)


def test_kernel_decode_forms_equal_the_table():
    codes = jnp.arange(16, dtype=jnp.int32)
    packed = jnp.asarray([c | (c << 4) for c in range(16)], jnp.uint8).reshape(1, 16, 1)   # both nibbles = c
    table = np.asarray(dequantize(Mxfp4Weight(packed, jnp.full((1, 1, 1), 127, jnp.uint8)), jnp.float32))[0, :, 0]
    np.testing.assert_array_equal(table[0::2], table[1::2])
    np.testing.assert_array_equal(np.asarray(decode_e2m1(codes)), table[0::2])
    s = jnp.arange(1, 255, dtype=jnp.int32).astype(jnp.uint8)
    np.testing.assert_array_equal(np.asarray(scale_factor(s)), np.ldexp(1.0, np.arange(1, 255) - 127).astype(np.float32))
    # The bit form: value x 2^-126 (subnormal for +-0.5), and a factor that restores it with 2^64 (which the
    # kernels put on the activations).
    packed_codes = jnp.asarray([c | (c << 4) for c in range(16)], jnp.int32)
    for high in (False, True):
        raw = np.asarray(decode_e2m1_raw(packed_codes, high), np.float64)
        np.testing.assert_array_equal(np.ldexp(raw, 126), table[0::2])
    s = np.arange(256)
    factor = np.asarray(raw_scale_factor(jnp.asarray(s, jnp.uint8)), np.float64)
    exact = (s >= 66) & (s <= 192)
    weights = np.ldexp(raw[:, None] * factor[None, exact], RAW_SCALE_OFFSET)          # [code, s]
    np.testing.assert_array_equal(weights, table[0::2][:, None] * np.ldexp(1.0, s[exact] - 127)[None, :])
    assert not factor[s < 66].any() and np.isinf(factor[s > 192]).all()


def _weights(rng, g, k, n):
    return from_checkpoint_layout(*(jnp.asarray(t) for t in _checkpoint_tensors(rng, g, n, k)))


@pytest.mark.parametrize("m,k,n,g,blocks,dtype", [
    (8, 64, 32, 16, TileBlocks(16, 32, 64), "bfloat16"),    # decode-sized groups, most empty; two scale groups a step
    (200, 96, 64, 4, TileBlocks(64, 64, 32), "bfloat16"),   # prefill-shaped tiles; K = 3 scale groups, one a step
    (200, 128, 64, 4, TileBlocks(64, 64, 64, e2m1="asm"), "bfloat16"),   # raw bf16 values from inline PTX
    (24, 128, 64, 16, TileBlocks(16, 64, 64, e2m1="asm"), "bfloat16"),   # the same in 16-row tiles
    (40, 128, 64, 4, TileBlocks(16, 64, 64, e2m1="asm"), "float32"),     # fp32 activations: exact weights instead
])
def test_grouped_kernels_on_packed_weights(rng, interpret, m, k, n, g, blocks, dtype):
    if interpret and blocks.e2m1 == "asm" and dtype == "bfloat16":
        pytest.skip("inline PTX runs in a compiled kernel only (its CPU coverage: the lowering test below)")
    lhs = jnp.asarray(rng.standard_normal((m, k)) / 4, dtype)
    w_gate, w_up = _weights(rng, g, k, n), _weights(rng, g, k, n)
    dense = [dequantize(w) for w in (w_gate, w_up)]
    sizes = rng.multinomial(m - 5, rng.dirichlet(np.ones(g) * 0.5)).astype(np.int32)
    gs = jnp.asarray(sizes)
    row_scale = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    out = grouped_matmul_pallas(lhs, w_gate, gs, row_scale, blocks=blocks, interpret=interpret)
    assert_close("matmul", out, grouped_matmul_reference(lhs, dense[0], gs, row_scale),
                 dtype=kernel_dtype(dtype, interpret))
    assert not np.asarray(out[int(sizes.sum()):]).any()
    spec = GluSpec("situ", 4.0, 25.0)
    out = grouped_glu_pallas(lhs, w_gate, w_up, gs, spec=spec, blocks=blocks, interpret=interpret)
    assert_close("glu", out, grouped_glu_reference(lhs, *dense, gs, spec=spec), dtype=kernel_dtype(dtype, interpret))


def _flushes_subnormals() -> bool:
    return float(jax.jit(lambda x: x * 2.0)(jnp.float32(2.0 ** -140))) == 0.0


def _without_halves(packed):
    """Nibble codes 1 and 9 (+-0.5) -> 2 and 10 (+-1)."""
    lo, hi = packed & 15, packed >> 4
    lo, hi = (jnp.where((c & 7) == 1, c + 1, c) for c in (lo, hi))
    return (lo | (hi << 4)).astype(jnp.uint8)


@pytest.mark.parametrize("repeat,blocks", [
    (4, None),                                               # the default: CUDA-core rows, the reduction in
                                                             # parts (PTX decode compiled, table interpreted)
    (1, TileBlocks(16, 32, 64, gemv=True, e2m1="bits")),     # CUDA-core rows, bit decode
    (3, TileBlocks(16, 64, 64, gemv=True, e2m1="asm")),      # CUDA-core rows, inline-PTX decode (compiled only)
    (2, TileBlocks(16, 64, 32, gemv=True, e2m1="asm", split_k=2)),               # the reduction in parts
    (3, TileBlocks(16, 32, 32, gemv=True, e2m1="table", split_k=4)),
    (1, TileBlocks(16, 32, 32, gemv=True, e2m1="table", split_k=0)),             # parts chosen by the launch size
    (2, TileBlocks(16, 32, 64, gemv=True, e2m1="table")),    # CUDA-core rows, table decode
    (4, TileBlocks(16, 32, 64)),                             # 16-row tensor-core tiles
    (2, TileBlocks(16, 64, 64, e2m1="asm")),                 # the same on raw bf16 values from inline PTX
])
def test_pair_kernels_on_packed_weights(rng, interpret, repeat, blocks):
    if interpret and blocks is not None and blocks.e2m1 == "asm":
        pytest.skip("inline PTX runs in a compiled kernel only (its CPU coverage: the lowering test below)")
    tokens, k, n, g = 3, 128, 64, 10
    lhs = jnp.asarray(rng.standard_normal((tokens, k)) / 4, jnp.bfloat16)
    w_gate, w_up = _weights(rng, g, k, n), _weights(rng, g, k, n)
    if blocks is not None and blocks.gemv and blocks.e2m1 == "bits" and _flushes_subnormals():
        # The bit decode makes codes +-0.5 subnormal on their way; a host that flushes subnormals (XLA's
        # CPU does) cannot run it on them, so here they become +-1. Compiled on the GPU every code runs.
        w_gate, w_up = (Mxfp4Weight(_without_halves(w.packed), w.scale) for w in (w_gate, w_up))
    dense = [dequantize(w) for w in (w_gate, w_up)]
    group = jnp.asarray(rng.integers(0, g, tokens * repeat), jnp.int32)
    valid = jnp.asarray(rng.uniform(size=tokens * repeat) > 0.3)
    out = pair_glu_pallas(lhs, w_gate, w_up, group, valid, repeat=repeat, blocks=blocks, interpret=interpret)
    assert_close("pair glu", out, pair_glu_reference(lhs, *dense, group, valid, repeat=repeat), dtype="bfloat16")
    down_in = jnp.asarray(rng.standard_normal((tokens * repeat, k)) / 4, jnp.bfloat16)
    scale = jnp.asarray(rng.uniform(0.1, 1.0, tokens * repeat), jnp.float32)
    out = pair_matmul_pallas(down_in, w_up, group, valid, scale, blocks=blocks, interpret=interpret)
    assert_close("pair matmul", out, pair_matmul_reference(down_in, dense[1], group, valid, scale), dtype="bfloat16")


def _asm_forms(packed, scale):
    """decode_e2m1_asm, decode_e2m1_bf16_asm and raw_scale_factor_asm over [4, 256] uint8 arrays in one
    compiled kernel."""
    def kernel(p_ref, s_ref, lo_ref, hi_ref, lo16_ref, hi16_ref, f_ref):
        lo_ref[...], hi_ref[...] = decode_e2m1_asm(p_ref[...])
        lo16_ref[...], hi16_ref[...] = decode_e2m1_bf16_asm(p_ref[...])
        f_ref[...] = raw_scale_factor_asm(s_ref[...])
    f32, bf16 = (jax.ShapeDtypeStruct(packed.shape, t) for t in (jnp.float32, jnp.bfloat16))
    return pl.pallas_call(kernel, out_shape=(f32, f32, bf16, bf16, f32))(packed, scale)


@on_gpu
def test_inline_ptx_decode_equals_the_bit_forms():
    """Every byte's two nibbles bit for bit as `decode_e2m1_raw` (fp32) and as its top 16 bits (bf16,
    which keep every code); every scale as `raw_scale_factor` where that is exact (s >= 66), and
    2^(s - 65) below it. Row r holds all 256 values rotated by r, so each value passes through every
    byte position of a 32-bit register."""
    values = np.stack([np.roll(np.arange(256), r) for r in range(4)]).astype(np.uint8)     # [4, 256]
    packed = scale = jnp.asarray(values)
    lo, hi, lo16, hi16, factor = (np.asarray(v) for v in jax.jit(_asm_forms)(packed, scale))
    codes = packed.astype(jnp.int32)
    for ours, ours16, high in ((lo, lo16, False), (hi, hi16, True)):
        want = np.asarray(decode_e2m1_raw(codes, high)).view(np.int32)
        np.testing.assert_array_equal(ours.view(np.int32), want)
        np.testing.assert_array_equal(ours16.view(np.uint16), (want.view(np.uint32) >> 16).astype(np.uint16))
    s = np.asarray(scale).astype(np.int64)
    expected = np.where(s >= 66, np.asarray(raw_scale_factor(scale)), np.ldexp(1.0, s - 65)).astype(np.float32)
    np.testing.assert_array_equal(factor, expected)


@pytest.mark.parametrize("blocks", [
    TileBlocks(16, 64, 128, num_stages=3, gemv=True, e2m1="asm"),                        # CUDA-core rows
    TileBlocks(16, 64, 128, num_stages=3, gemv=True, e2m1="asm", split_k=0),             # in parts
    TileBlocks(16, 64, 128, num_stages=3, e2m1="asm"),                                   # 16-row tiles
])
def test_inline_ptx_kernels_lower_for_cuda(triton_for_hopper, blocks):
    """The inline-PTX pair kernels at Kimi-Linear's expert shape lower to Triton for sm_90 on any host
    (the GPU run compiles and checks them against the references: the tests above)."""
    e, d, f, k = 256, 2304, 1024, 8
    sds = jax.ShapeDtypeStruct
    w = Mxfp4Weight(sds((e, d // 2, f), jnp.uint8), sds((e, d // 32, f), jnp.uint8))
    call = jax.jit(lambda x, wg, wu, g, v: pair_glu_pallas(x, wg, wu, g, v, repeat=k, blocks=blocks, interpret=False))
    module = jax.export.export(call, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        sds((1, d), jnp.bfloat16), w, w, sds((k,), jnp.int32), sds((k,), jnp.bool_))
    assert module.mlir_module().count("__gpu$xla.gpu.triton") == 1


def test_dispatch_dequantises_for_the_reference_paths(rng):
    lhs = jnp.asarray(rng.standard_normal((6, 64)) / 4, jnp.bfloat16)
    w_gate, w_up = _weights(rng, 3, 64, 32), _weights(rng, 3, 64, 32)
    gs = jnp.asarray([2, 0, 4], jnp.int32)
    out = grouped_glu(lhs, w_gate, w_up, gs, impl="xla")
    assert_close("xla", out, grouped_glu_reference(lhs, dequantize(w_gate), dequantize(w_up), gs), dtype="bfloat16")
    group, valid = jnp.asarray([0, 2, 1, 2, 0, 1], jnp.int32), jnp.ones(6, bool)
    out = pair_glu(lhs, w_gate, w_up, group, valid, impl="xla")
    assert_close("pairs xla", out, pair_glu_reference(lhs, dequantize(w_gate), dequantize(w_up), group, valid),
                 dtype="bfloat16")


def test_split_k_settings():
    from pallas_kernels.moe_gmm.kernel import _split_k
    assert _split_k(0, 18, 128) == 3          # Kimi-Linear gate|up at one token: 128 programs, 18 steps of 128
    assert _split_k(0, 8, 288) == 1           # enough programs already
    assert _split_k(4, 8, 288) == 4
    with pytest.raises(ValueError, match="split_k=4 does not divide the 18"):
        _split_k(4, 18, 128)


def test_rejects_malformed_packed_weights():
    good = Mxfp4Weight(jnp.zeros((2, 16, 8), jnp.uint8), jnp.zeros((2, 1, 8), jnp.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(Mxfp4Weight(good.packed.astype(jnp.int8), good.scale))
    with pytest.raises(ValueError, match="scale"):
        dequantize(Mxfp4Weight(good.packed, jnp.zeros((2, 2, 8), jnp.uint8)))
    with pytest.raises(ValueError, match="must both be MXFP4"):
        grouped_glu_pallas(jnp.zeros((4, 32), jnp.bfloat16), good, jnp.zeros((2, 32, 8), jnp.bfloat16),
                           jnp.asarray([2, 2], jnp.int32))
