"""The routed experts' MLP with the gated launch handing its tiles to the down launch
(`hopper_mxfp4_mlp.grouped_mlp_hopper_mxfp4`): bit for bit the two calls it replaces (`grouped_glu_hopper_mxfp4`
then `grouped_matmul_hopper_mxfp4`, same settings), and close to the dense reference on the dequantised weights.
Interpret mode on the CPU; compiled on a GPU, the persistent launch too."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

from pallas_kernels.moe_gmm import (GluSpec, Mxfp4Weight, dense_weight, grouped_glu, grouped_glu_reference,
                                    grouped_matmul_reference, grouped_mlp, pair_glu)
from pallas_kernels.moe_gmm import hopper_mxfp4
from pallas_kernels.moe_gmm.hopper_mxfp4 import (HopperMxfp4Blocks, Mxfp4Columns, WordHandOffColumns,
                                                 grouped_glu_hopper_mxfp4, grouped_matmul_hopper_mxfp4, to_columns)
from pallas_kernels.moe_gmm.hopper_mxfp4_decode import SCALED_MAX_SCALE, WORD_BYTES
from pallas_kernels.moe_gmm.hopper_mxfp4_mlp import HandOffColumns, grouped_mlp_hopper_mxfp4, hand_off_columns
from pallas_kernels.moe_gmm.hopper_mxfp4_persistent import launch_persistent
from pallas_kernels.moe_gmm.mxfp4 import dequantize

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="Mosaic GPU kernels compile on a GPU only")


def _weight(rng, g, k, n) -> Mxfp4Weight:
    """Every E2M1 code, scales around 2^0 up to 2, the largest the compiled default ("scaled") decodes exactly."""
    return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (g, k // 2, n), dtype=np.uint8)),
                       jnp.asarray(rng.integers(122, SCALED_MAX_SCALE + 1, (g, k // 32, n), dtype=np.uint8)))


def _experts(rng, sizes, m, d, f, d_out, dtype=jnp.bfloat16):
    g = len(sizes)
    wg, wu, wd = _weight(rng, g, d, f), _weight(rng, g, d, f), _weight(rng, g, f, d_out)
    x = jnp.asarray(rng.standard_normal((m, d)) * 0.05, dtype)
    scale = jnp.asarray(rng.uniform(0.1, 1.0, (m,)), jnp.float32)
    return x, scale, jnp.asarray(sizes, jnp.int32), (wg, wu, wd)


def _two_calls(x, columns, sizes, scale, spec, blocks, interpret):
    wg, wu, wd = columns
    h = grouped_glu_hopper_mxfp4(x, wg, wu, sizes, spec=spec, blocks=blocks, interpret=interpret)
    return grouped_matmul_hopper_mxfp4(h, wd, sizes, scale, blocks=blocks, interpret=interpret)


def _reference(x, weights, sizes, scale, spec):
    """The dense MLP on the dequantised weights, x and h rounded to bf16 as the kernel's MMA takes them."""
    dg, du, dd = (dequantize(w, jnp.float32) for w in weights)
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)
    h = grouped_glu_reference(xb, dg, du, sizes, spec=spec).astype(jnp.bfloat16)
    return grouped_matmul_reference(h.astype(jnp.float32), dd, sizes, scale)


# Group sizes: an empty group, a group longer than a tile, rows past the groups (zeros); how the down launch
# writes its products (the gated launch writes tiles either way); K splits (both launches' two steps, their
# parts added after each); the activations' dtype (fp32: rounded to bf16 for the MMA, h in fp32 before its own
# rounding).
CASES = [([3, 0, 5, 3], 12, 8, "tiles", 1, jnp.bfloat16), ([0, 19, 1, 0, 4], 26, 8, "rows", 2, jnp.bfloat16),
         ([2, 0, 0, 17], 20, 16, "rows", 1, jnp.float32)]


@pytest.mark.parametrize("sizes,m,rows,outputs,splits,dtype", CASES)
def test_hand_off_equals_the_two_calls_and_the_reference(rng, interpret, sizes, m, rows, outputs, splits, dtype):
    """16-row tiles with K3's SiTU, 8-row ones with SiLU."""
    spec = GluSpec("situ", situ_beta=4.0, situ_linear_beta=8.0) if rows == 16 else GluSpec()
    x, scale, group_sizes, weights = _experts(rng, sizes, m, 256, 256, 128, dtype)
    columns = tuple(to_columns(w) for w in weights)
    blocks = HopperMxfp4Blocks.for_backend(interpret, rows=rows, block_k=128, outputs=outputs, splits=splits)
    out = grouped_mlp_hopper_mxfp4(x, *columns, group_sizes, scale, spec=spec, blocks=blocks, interpret=interpret)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_two_calls(x, columns, group_sizes, scale, spec,
                                                                         blocks, interpret)))
    assert_close("mlp", out, _reference(x, weights, group_sizes, scale, spec), dtype=jnp.bfloat16)
    assert not np.asarray(out[sum(sizes):]).any()
    unscaled = grouped_mlp_hopper_mxfp4(x, *columns, group_sizes, spec=spec, blocks=blocks, interpret=interpret)
    assert unscaled.dtype == dtype
    assert_close("unscaled", unscaled, _reference(x, weights, group_sizes, None, spec), dtype=jnp.bfloat16)


SITU = GluSpec("situ", situ_beta=4.0, situ_linear_beta=8.0)


@pytest.mark.parametrize("sizes,m,rows,spec,dtype,code_load", [
    ([3, 0, 5, 3], 12, 8, GluSpec(), jnp.bfloat16, "pairs"), ([0, 19, 1, 0, 4], 26, 16, SITU, jnp.float32, "pairs"),
    ([3, 0, 5, 3], 12, 8, SITU, jnp.bfloat16, "words")])
def test_glu_in_the_gated_launch_equals_the_products_hand_off(rng, interpret, sizes, m, rows, spec, dtype,
                                                              code_load):
    """hand_off="glu" on gate and up weights with their columns in the down launch's `k_order` (`even_odd`, or
    `word_order` for codes loaded a word at a time): the products hand-off's result (same kernels, the GLU moved
    into the gated launch) and the dense reference; rows past the groups zero. (Without a row scale the two
    hand-offs share the code after the down launch: `test_hand_off_...` checks it.)"""
    x, scale, group_sizes, weights = _experts(rng, sizes, m, 256, 256, 128, dtype)
    wg, wu, wd = (to_columns(w) for w in weights)
    blocks = dataclasses.replace(HopperMxfp4Blocks.for_backend(interpret, rows=rows, block_k=128), code_load=code_load)
    run = lambda hand_off, gate, up, scale: grouped_mlp_hopper_mxfp4(
        x, gate, up, wd, group_sizes, scale, spec=spec, blocks=blocks, interpret=interpret, hand_off=hand_off)
    out = run("glu", hand_off_columns(wg, code_load), hand_off_columns(wu, code_load), scale)
    assert out.dtype == jnp.float32
    assert_close("glu in the gated launch", out, run("products", wg, wu, scale), dtype=jnp.bfloat16)
    assert_close("mlp", out, _reference(x, weights, group_sizes, scale, spec), dtype=jnp.bfloat16)
    assert not np.asarray(out[sum(sizes):]).any()


def test_hand_off_columns_permute_whole_columns(rng):
    """Column j of the permuted weight is column even_odd(j) (word_order(j) for a down launch loading words):
    codes and scales move together."""
    w = to_columns(_weight(rng, 2, 64, 64))
    moved = hand_off_columns(w)
    assert type(moved) is HandOffColumns and moved.shape == w.shape
    with pytest.raises(ValueError, match="already in a hand-off order"):
        hand_off_columns(moved)
    with pytest.raises(ValueError, match="code_load must be 'pairs' or 'words'"):
        hand_off_columns(w, "bytes")
    order = np.arange(64).reshape(2, 16, 2).swapaxes(1, 2).reshape(64)       # each 32: the even, then the odd
    np.testing.assert_array_equal(np.asarray(moved.packed), np.asarray(w.packed)[:, order])
    np.testing.assert_array_equal(np.asarray(moved.scale), np.asarray(w.scale)[:, :, order])
    words = hand_off_columns(w, "words")
    assert type(words) is WordHandOffColumns
    # each half of a group (its 16 even inputs, its 16 odd ones) by the bytes a word decode takes in turn
    word_order = order.reshape(4, 16)[:, list(WORD_BYTES)].reshape(64)
    np.testing.assert_array_equal(np.asarray(words.packed), np.asarray(w.packed)[:, word_order])
    np.testing.assert_array_equal(np.asarray(words.scale), np.asarray(w.scale)[:, :, word_order])


@pytest.mark.parametrize("code_load", ["pairs", "words"])
def test_ops_take_hand_off_weights_on_every_path(rng, code_load):
    """The dispatch ops on hand-off gate and up weights: `grouped_mlp` (the GLU hand-off, or the two calls for
    words), `grouped_glu` and `pair_glu` (h put back in order) through the kernel in interpret mode, and the
    references (the columns put back in order first), all equal to the same ops on the plain columns."""
    x, scale, group_sizes, weights = _experts(rng, [3, 0, 5, 3], 12, 256, 256, 128)
    wg, wu, wd = (to_columns(w) for w in weights)
    hg, hu = hand_off_columns(wg, code_load), hand_off_columns(wu, code_load)
    np.testing.assert_array_equal(np.asarray(dense_weight(hg, jnp.float32)), np.asarray(dense_weight(wg, jnp.float32)))
    # Under jit too (the hand-off order is a constant of the trace, not a traced value).
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda w: dense_weight(w, jnp.float32))(hg)),
                                  np.asarray(dense_weight(wg, jnp.float32)))
    for impl in ("pallas", "xla"):
        assert_close(f"grouped_mlp {impl}", grouped_mlp(x, hg, hu, wd, group_sizes, scale, spec=SITU, impl=impl),
                     grouped_mlp(x, wg, wu, wd, group_sizes, scale, spec=SITU, impl=impl), dtype=jnp.bfloat16)
        assert_close(f"grouped_glu {impl}", grouped_glu(x, hg, hu, group_sizes, impl=impl),
                     grouped_glu(x, wg, wu, group_sizes, impl=impl), dtype=jnp.bfloat16)
        group = jnp.asarray(rng.integers(0, 4, (6,)), jnp.int32)
        valid = jnp.asarray([True, True, False, True, True, True])
        assert_close(f"pair_glu {impl}", pair_glu(x[:3], hg, hu, group, valid, repeat=2, impl=impl),
                     pair_glu(x[:3], wg, wu, group, valid, repeat=2, impl=impl), dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="must both be"):
        grouped_glu(x, hg, wu, group_sizes, impl="pallas")


GLU_LOWERINGS = {"grid_8_rows": (GluSpec(), HopperMxfp4Blocks()), "grid_defaults_16_rows": (SITU, None),
                 "persistent": (GluSpec(), HopperMxfp4Blocks(launch="persistent", outputs="rows")),
                 "grid_words_scaled": (GluSpec(), HopperMxfp4Blocks(mma_inputs=0, code_load="words", decode="scaled"))}


@pytest.mark.parametrize("form", list(GLU_LOWERINGS))
def test_glu_hand_off_lowers_for_cuda_on_any_host(form, monkeypatch):
    """The gated launch with the GLU epilogue, then the down launch, lowered for CUDA (interpret mode runs the
    grid epilogue's math, not its shared-memory layouts, and cannot run the persistent launch). A persistent
    setting takes both launches through the persistent kernel."""
    k, f, d = 512, 256, 128
    args = (jax.ShapeDtypeStruct((37, k), jnp.bfloat16), jax.ShapeDtypeStruct((4, f, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((4, k // 32, f), jnp.uint8), jax.ShapeDtypeStruct((4, d, f // 2), jnp.uint8),
            jax.ShapeDtypeStruct((4, f // 32, d), jnp.uint8), jax.ShapeDtypeStruct((4,), jnp.int32))
    spec, blocks = GLU_LOWERINGS[form]
    launched = []

    def spy(sched, x, weights, *rest):
        launched.append((len(weights), rest[4] is not None))                            # (weights, GLU epilogue)
        return launch_persistent(sched, x, weights, *rest)

    monkeypatch.setattr(hopper_mxfp4, "launch_persistent", spy)
    grouped_mlp_hopper_mxfp4.clear_cache()                      # traced anew, so through the spy

    kind = WordHandOffColumns if blocks is not None and blocks.code_load == "words" else HandOffColumns

    def mlp(x, p, s, p_down, s_down, sizes):
        return grouped_mlp_hopper_mxfp4(x, kind(p, s), kind(p, s),
                                        Mxfp4Columns(p_down, s_down), sizes, spec=spec, blocks=blocks,
                                        interpret=False, hand_off="glu")

    module = jax.export.export(jax.jit(mlp), platforms=["cuda"])(*args).mlir_module()
    assert module.count("mosaic_gpu") >= 2
    assert launched == ([(2, True), (1, False)] if blocks is not None and blocks.launch == "persistent" else [])


def test_default_settings_equal_the_two_calls(rng, interpret):
    """No settings given: each projection's own default (the same tiles), as the two calls take them."""
    x, scale, group_sizes, weights = _experts(rng, [5, 0, 9], 16, 256, 256, 128)
    columns = tuple(to_columns(w) for w in weights)
    out = grouped_mlp_hopper_mxfp4(x, *columns, group_sizes, scale, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_two_calls(x, columns, group_sizes, scale, GluSpec(),
                                                                         None, interpret)))


def test_refuses_what_it_cannot_hand_off(rng):
    x, _, sizes, (wg, wu, wd) = _experts(rng, [2, 2], 4, 256, 128, 128)
    wg, wu, wd = to_columns(wg), to_columns(wu), to_columns(wd)
    with pytest.raises(ValueError, match="activations must be 'slab'"):
        grouped_mlp_hopper_mxfp4(x, wg, wu, wd, sizes, blocks=HopperMxfp4Blocks(activations="rows", decode="exact",
                                                                                  a_operand="smem"), interpret=True)
    with pytest.raises(ValueError, match="hand_off must be one of"):
        grouped_mlp_hopper_mxfp4(x, wg, wu, wd, sizes, interpret=True, hand_off="rows")
    pg, pu = hand_off_columns(wg), hand_off_columns(wu)
    taken_by_glu = "hand_off='glu' takes the gate and up weights from hand_off_columns .*, got Mxfp4Columns"
    only_glu = "weights from hand_off_columns .* are for the gate and up of grouped_mlp_hopper_mxfp4"
    with pytest.raises(ValueError, match=taken_by_glu):
        grouped_mlp_hopper_mxfp4(x, wg, wu, wd, sizes, interpret=True, hand_off="glu")
    with pytest.raises(ValueError, match=taken_by_glu):
        grouped_mlp_hopper_mxfp4(x, pg, wu, wd, sizes, interpret=True, hand_off="glu")
    with pytest.raises(ValueError, match=only_glu):
        grouped_mlp_hopper_mxfp4(x, pg, pu, wd, sizes, interpret=True)
    with pytest.raises(ValueError, match=only_glu):
        grouped_mlp_hopper_mxfp4(x, pg, pu, hand_off_columns(wd), sizes, interpret=True, hand_off="glu")
    with pytest.raises(ValueError, match=only_glu):
        grouped_glu_hopper_mxfp4(x, pg, pu, sizes, interpret=True)
    with pytest.raises(ValueError, match=only_glu):
        grouped_matmul_hopper_mxfp4(x, pg, sizes, interpret=True)
    with pytest.raises(ValueError, match="code_load='words' does not read"):
        grouped_mlp_hopper_mxfp4(x, pg, pu, wd, sizes, interpret=True, hand_off="glu",
                                 blocks=HopperMxfp4Blocks(block_k=128, code_load="words", decode="exact",
                                                          a_operand="smem"))
    with pytest.raises(ValueError, match="code_load='pairs' does not read"):
        grouped_mlp_hopper_mxfp4(x, hand_off_columns(wg, "words"), hand_off_columns(wu, "words"), wd, sizes,
                                 interpret=True, hand_off="glu")
    mixed = r"different hand-off orders \(HandOffColumns, WordHandOffColumns\)"
    with pytest.raises(ValueError, match=mixed):
        grouped_mlp_hopper_mxfp4(x, pg, hand_off_columns(wu, "words"), wd, sizes, interpret=True, hand_off="glu")
    with pytest.raises(ValueError, match="GLU epilogue needs each tile's whole K in one program; got splits=2"):
        grouped_mlp_hopper_mxfp4(x, pg, pu, wd, sizes, interpret=True, hand_off="glu",
                                 blocks=HopperMxfp4Blocks(block_k=128, splits=2, decode="exact", a_operand="smem"))
    with pytest.raises(ValueError, match=r"w_down must be \[2, 128, D'\]"):
        grouped_mlp_hopper_mxfp4(x, wg, wu, wg, sizes, interpret=True)
    narrow = to_columns(_weight(rng, 2, 128, 192))             # D' = 192: not whole 128-column blocks
    with pytest.raises(ValueError, match="N a multiple of 128, got N=192"):
        grouped_mlp_hopper_mxfp4(x, wg, wu, narrow, sizes, interpret=False,
                                 blocks=HopperMxfp4Blocks(launch="persistent", block_k=128))


@on_gpu
@pytest.mark.parametrize("blocks", [None, HopperMxfp4Blocks(launch="persistent", outputs="rows"),
                                    HopperMxfp4Blocks(launch="persistent", programs=5)],
                         ids=["default", "persistent_rows_out", "persistent_5_programs"])
@pytest.mark.parametrize("sizes,m", [([3, 0, 5, 3], 12), ([0, 19, 1, 0, 40, 7, 0, 30], 100)])
def test_compiled_hand_off_equals_the_two_calls(rng, blocks, sizes, m):
    x, scale, group_sizes, weights = _experts(rng, sizes, m, 1024, 256, 384)
    columns = tuple(to_columns(w) for w in weights)
    out = grouped_mlp_hopper_mxfp4(x, *columns, group_sizes, scale, blocks=blocks, interpret=False)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_two_calls(x, columns, group_sizes, scale, GluSpec(),
                                                                         blocks, False)))
    assert_close("mlp", out, _reference(x, weights, group_sizes, scale, GluSpec()), dtype=jnp.bfloat16)


@on_gpu
@pytest.mark.parametrize("blocks", [None, HopperMxfp4Blocks(launch="persistent", outputs="rows"),
                                    HopperMxfp4Blocks(launch="persistent", programs=5),
                                    HopperMxfp4Blocks(mma_inputs=0, code_load="words")],
                         ids=["default", "persistent_rows_out", "persistent_5_programs", "words"])
@pytest.mark.parametrize("spec", [GluSpec(), SITU], ids=["silu", "situ"])
@pytest.mark.parametrize("sizes,m", [([3, 0, 5, 3], 12), ([0, 19, 1, 0, 40, 7, 0, 30], 100)])
def test_compiled_glu_hand_off_equals_the_products_hand_off(rng, blocks, spec, sizes, m):
    x, scale, group_sizes, weights = _experts(rng, sizes, m, 1024, 256, 384)
    wg, wu, wd = (to_columns(w) for w in weights)
    code_load = "pairs" if blocks is None else blocks.code_load
    out = grouped_mlp_hopper_mxfp4(x, hand_off_columns(wg, code_load), hand_off_columns(wu, code_load), wd,
                                   group_sizes, scale, spec=spec, blocks=blocks, interpret=False, hand_off="glu")
    products = grouped_mlp_hopper_mxfp4(x, wg, wu, wd, group_sizes, scale, spec=spec, blocks=blocks, interpret=False)
    assert_close("glu in the gated launch", out, products, dtype=jnp.bfloat16)
    assert_close("mlp", out, _reference(x, weights, group_sizes, scale, spec), dtype=jnp.bfloat16)
    assert not np.asarray(out[sum(sizes):]).any()
