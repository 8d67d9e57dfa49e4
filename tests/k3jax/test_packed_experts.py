"""Routed experts kept packed as MXFP4 on the device (`load(..., packed_experts=True)`): the same
model as the dequantising load, a quarter of the expert bytes, on one device and sharded."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from checkpoints import rewrite_tensors, snap_experts_to_mxfp4
from tolerances import assert_close

import k3jax
from k3jax.checkpoint import convert as convert_module
from k3jax.checkpoint.convert import convert
from k3jax.checkpoint.safetensors_io import CheckpointError
from k3jax.checkpoint.transforms import HOOKS
from k3jax.checkpoint.writer import save_checkpoint
from k3jax.config import tiny_k3
from k3jax.errors import ConfigError
from k3jax.layers import moe_experts
from k3jax.layers.activation import Activation
from k3jax.layers.moe_experts import local_experts
from k3jax.memory_plan import plan_memory
from k3jax.sharding import MeshSpec, make_mesh
from pallas_kernels.moe_gmm import HandOffColumns, Mxfp4Columns, Mxfp4Weight, hand_off_columns, to_columns
from pallas_kernels.moe_gmm.hopper_mxfp4_decode import SCALED_MAX_SCALE


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    """A tiny K3 checkpoint whose routed experts are stored as MXFP4 (values snapped to the grid)."""
    cfg = dataclasses.replace(tiny_k3(num_layers=4, attn_res_block_size=2), quantization="mxfp4")
    path = tmp_path_factory.mktemp("k3_mxfp4") / "ckpt"
    save_checkpoint(snap_experts_to_mxfp4(k3jax.CausalLM.random(cfg, seed=5)), path, shards=2)
    return path


def _ids(cfg, rng, shape=(2, 11)):
    return jnp.asarray(rng.integers(0, cfg.vocab_size, shape), jnp.int32)


def _moe_layer(model):
    return next(layer for layer in model.module.model.layers if hasattr(layer, "block_sparse_moe"))


@pytest.mark.parametrize("impls", [{}, {"moe": "ragged", "gmm": "pallas"}, {"moe": "pairs", "gmm": "pallas"}])
def test_packed_load_equals_the_dequantising_load(mxfp4_dir, rng, impls):
    dense = k3jax.load(mxfp4_dir, dtype="float32")
    packed = k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True, **impls)
    experts = _moe_layer(packed).block_sparse_moe.experts
    cfg = packed.config.moe
    assert experts.w1_packed[...].dtype == jnp.uint8
    assert experts.w1_packed[...].shape == (cfg.num_experts, cfg.expert_input_size // 2, cfg.expert_intermediate_size)
    assert experts.w2_scale[...].shape == (cfg.num_experts, cfg.expert_intermediate_size // 32, cfg.expert_input_size)
    ids = _ids(packed.config, rng)
    assert_close(f"logits {impls}", packed.logits(ids), dense.logits(ids), dtype="float32")


def test_columns_layout_keeps_the_stored_codes_and_the_same_model(mxfp4_dir, rng):
    """expert_layout="columns": the codes as the checkpoint stores each expert ([out, in/2], copied),
    the scales as in "rows"; the same logits as the "rows" load, on one device and over experts."""
    rows = k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True)
    cols = k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True, expert_layout="columns")
    cfg = cols.config.moe
    assert cfg.packed_layout == "columns"
    e, d, f = cfg.num_experts, cfg.expert_input_size, cfg.expert_intermediate_size
    experts, row_experts = _moe_layer(cols).block_sparse_moe.experts, _moe_layer(rows).block_sparse_moe.experts
    assert experts.w1_packed[...].shape == (e, f, d // 2) and experts.w2_packed[...].shape == (e, d, f // 2)
    np.testing.assert_array_equal(np.asarray(experts.w2_packed[...]),
                                  np.swapaxes(np.asarray(row_experts.w2_packed[...]), 1, 2))
    np.testing.assert_array_equal(np.asarray(experts.w1_scale[...]), np.asarray(row_experts.w1_scale[...]))
    ids = _ids(cols.config, rng, (4, 9))
    expected = rows.logits(ids)
    assert_close("columns", cols.logits(ids), expected, dtype="float32")
    sharded = k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True, expert_layout="columns",
                         mesh=make_mesh(MeshSpec(data=2, expert=4)))
    assert_close("columns over experts", sharded.logits(ids), expected, dtype="float32")


def test_converted_columns_layout_loads_as_written(mxfp4_dir, tmp_path, rng):
    convert(mxfp4_dir, tmp_path / "cols", dtype="float32", expert_layout="columns", progress=False)
    loaded = k3jax.load(tmp_path / "cols")
    assert loaded.config.moe.packed_experts and loaded.config.moe.packed_layout == "columns"
    ids = _ids(loaded.config, rng)
    assert_close("converted columns", loaded.logits(ids),
                 k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True).logits(ids), dtype="float32")
    with pytest.raises(CheckpointError, match="converted with expert_layout='columns'"):
        k3jax.load(tmp_path / "cols", expert_layout="rows")
    with pytest.raises(ValueError, match="needs packed experts"):
        convert(mxfp4_dir, tmp_path / "bad", expert_layout="columns", packed_experts=False, progress=False)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.partial").exists()


def test_columns_layout_needs_packed_experts_and_is_fixed_at_load(mxfp4_dir):
    with pytest.raises(ConfigError, match="layout of packed experts"):
        k3jax.load(mxfp4_dir, dtype="float32", expert_layout="columns")           # dequantising load
    packed = k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True)
    with pytest.raises(ConfigError, match="load the checkpoint again with expert_layout='columns'"):
        packed.with_impls(expert_layout="columns")
    assert packed.with_impls(expert_layout="rows", gmm="xla").config.moe.gmm_impl == "xla"


@pytest.mark.parametrize("layout", ["columns", "handoff"])
def test_column_layouts_run_the_mosaic_gpu_kernel_in_the_model(rng, layout):
    """Expert widths the Mosaic GPU kernel takes (multiples of 128): gmm="pallas" runs it (interpret mode
    on the CPU) on the pairs and the sorted-rows paths, equal to the dequantising reference path. With "handoff"
    the sorted rows run the GLU hand-off and the pair kernels put h back in order; the reference puts the
    weights' columns back in order before dequantising them."""
    cfg = tiny_k3(num_layers=2, attn_res_block_size=2, num_mtp_layers=0)
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, latent_size=128, expert_intermediate_size=128,
                                              packed_experts=True, packed_layout=layout))
    model = k3jax.CausalLM.random(cfg, seed=2, dtype="bfloat16")
    ids = _ids(cfg, rng, (2, 5))
    expected = model.with_impls(gmm="xla").logits(ids)
    for moe in ("pairs", "ragged"):
        assert_close(f"{layout} kernel {moe}", model.with_impls(gmm="pallas", moe=moe).logits(ids), expected,
                     dtype="bfloat16")


def test_handoff_shards_of_experts_sum_to_the_whole_through_the_kernel(rng, monkeypatch):
    """The sorted-rows path on hand-off weights (`routed_mlp_hopper_mxfp4`, interpret mode), whole and per shard of
    the experts (expert_offset; pairs of the other shard add nothing): bit for bit the path it replaced (the sort,
    `grouped_mlp`'s hand-off and the unsort), and the shares sum to the dequantised reference."""
    e, d, f = 6, 128, 128
    packed = [Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (e, k // 2, n), dtype=np.uint8)),
                          jnp.asarray(rng.integers(122, SCALED_MAX_SCALE + 1, (e, k // 32, n), dtype=np.uint8)))
              for k, n in ((d, f), (d, f), (f, d))]
    w1, w3, w2 = (to_columns(w) for w in packed)
    w1, w3 = hand_off_columns(w1), hand_off_columns(w3)
    x = jnp.asarray(rng.standard_normal((11, d)) * 0.05, jnp.bfloat16)
    experts = jnp.asarray(np.stack([rng.permutation(e)[:3] for _ in range(11)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (11, 3)), jnp.float32)
    act = Activation("silu")
    whole = local_experts("dense", x, weights, experts, w1, w3, w2, act)
    calls = []
    original = moe_experts.routed_mlp_hopper_mxfp4
    monkeypatch.setattr(moe_experts, "routed_mlp_hopper_mxfp4", lambda *a, **k: calls.append(1) or original(*a, **k))
    shard = lambda w, o, n=3: type(w)(w.packed[o:o + n], w.scale[o:o + n])
    run = lambda o, n: local_experts("ragged", x, weights, experts, shard(w1, o, n), shard(w3, o, n), shard(w2, o, n),
                                     act, gmm="pallas", expert_offset=None if n == e else o)
    shares = [(0, e), (0, 3), (3, 3)]
    outs = [run(o, n) for o, n in shares]
    assert len(calls) == 3
    monkeypatch.setattr(moe_experts, "hand_off_runs", lambda *a: False)      # the sort, grouped_mlp, the unsort
    for (o, n), out in zip(shares, outs):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(run(o, n)), err_msg=f"experts {o}..{o + n - 1}")
    assert len(calls) == 3
    assert_close("whole (routed hand-off)", outs[0], whole, dtype="bfloat16")
    assert_close("sum of shards (routed hand-off)", outs[1] + outs[2], whole, dtype="bfloat16")


def test_handoff_layout_reorders_the_gate_and_up_columns_and_keeps_the_model(mxfp4_dir, tmp_path, rng):
    """expert_layout="handoff": "columns" with w1's and w3's outputs (codes and scales) reordered within each 32
    as the GLU hand-off writes h (`hand_off_columns`), w2 as in "columns"; the same logits (on one device, over
    experts, converted, and written back to a Hugging Face checkpoint that loads as the source does)."""
    cols = k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True, expert_layout="columns")
    hand = k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True, expert_layout="handoff")
    assert hand.config.moe.packed_layout == "handoff"
    experts, col_experts = _moe_layer(hand).block_sparse_moe.experts, _moe_layer(cols).block_sparse_moe.experts
    for name in ("w1", "w3"):
        want = hand_off_columns(Mxfp4Columns(getattr(col_experts, name + "_packed")[...],
                                             getattr(col_experts, name + "_scale")[...]))
        assert isinstance(experts.weights()[0], HandOffColumns)
        np.testing.assert_array_equal(np.asarray(getattr(experts, name + "_packed")[...]), np.asarray(want.packed))
        np.testing.assert_array_equal(np.asarray(getattr(experts, name + "_scale")[...]), np.asarray(want.scale))
    np.testing.assert_array_equal(np.asarray(experts.w2_packed[...]), np.asarray(col_experts.w2_packed[...]))
    ids = _ids(cols.config, rng, (4, 9))
    expected = cols.logits(ids)
    assert_close("handoff", hand.logits(ids), expected, dtype="float32")
    sharded = k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True, expert_layout="handoff",
                         mesh=make_mesh(MeshSpec(data=2, expert=4)))
    assert_close("handoff over experts", sharded.logits(ids), expected, dtype="float32")
    convert(mxfp4_dir, tmp_path / "hand", dtype="float32", expert_layout="handoff", progress=False)
    converted = k3jax.load(tmp_path / "hand")
    assert converted.config.moe.packed_layout == "handoff"
    assert_close("converted handoff", converted.logits(ids), expected, dtype="float32")
    save_checkpoint(hand, tmp_path / "hf", shards=1)                     # the hooks' inverses
    assert_close("written back", k3jax.load(tmp_path / "hf", dtype="float32", packed_experts=True).logits(ids),
                 expected, dtype="float32")


def test_handoff_layout_shards_whole_groups_of_outputs():
    with pytest.raises(ValueError, match="whole groups of 32 outputs, got outputs 16:48"):
        HOOKS["copy_uint8_hand_off"].region((slice(16, 48), slice(None)), (64, 32))
    with pytest.raises(ValueError, match="whole groups of 32 outputs, got outputs 0:16"):
        HOOKS["transpose_uint8_hand_off"].region((slice(None), slice(0, 16)), (64, 2))
    assert HOOKS["copy_uint8_hand_off"].region((slice(32, 64), slice(None)), (64, 32)) == (slice(32, 64),
                                                                                           slice(None))


def test_packed_experts_sharded_over_experts_equal_one_device(mxfp4_dir, rng):
    one = k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True)
    mesh = make_mesh(MeshSpec(data=2, expert=4))
    sharded = k3jax.load(mxfp4_dir, dtype="float32", packed_experts=True, mesh=mesh)
    scale = _moe_layer(sharded).block_sparse_moe.experts.w3_scale[...]
    assert len({s.index for s in scale.addressable_shards}) == 4          # split over the expert axis
    ids = _ids(one.config, rng, (4, 9))
    assert_close("sharded", sharded.logits(ids), one.logits(ids), dtype="float32")


def test_packed_model_takes_a_quarter_of_the_expert_bytes(mxfp4_dir):
    packed = k3jax.load(mxfp4_dir, dtype="bfloat16", packed_experts=True)
    mesh = MeshSpec()
    plan = plan_memory(packed.config, mesh, batch=1, context=64, dtype="bfloat16")
    dense_cfg = packed.config.replace(moe=dataclasses.replace(packed.config.moe, packed_experts=False))
    dense = plan_memory(dense_cfg, mesh, batch=1, context=64, dtype="bfloat16")
    assert plan.routed_experts == plan.routed_experts_mxfp4 == dense.routed_experts_mxfp4
    assert plan.routed_experts * 4 == pytest.approx(dense.routed_experts * (1 + 1 / 16), rel=1e-9)  # + scales
    held = sum(var.get_value().nbytes for path, var in nnx.to_flat_state(nnx.state(packed.module))
               if "experts" in path and str(path[-1]).endswith(("_packed", "_scale")))   # MTP layers' too
    assert held == plan.routed_experts


def test_packed_random_model_generates(rng):
    cfg = tiny_k3(num_layers=4, attn_res_block_size=2)
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, packed_experts=True))
    model = k3jax.CausalLM.random(cfg, seed=1)
    out = model.logits(_ids(cfg, rng))
    assert np.isfinite(np.asarray(out)).all() and float(jnp.std(out)) > 0


def test_packed_experts_need_an_mxfp4_checkpoint(tmp_path):
    cfg = tiny_k3(num_layers=4, attn_res_block_size=2)
    save_checkpoint(k3jax.CausalLM.random(cfg, seed=0), tmp_path / "bf16", shards=1)
    with pytest.raises(CheckpointError, match="packed experts need routed experts stored as MXFP4"):
        k3jax.load(tmp_path / "bf16", packed_experts=True)
    with pytest.raises(ConfigError, match="multiples of 32"):
        tiny_k3().moe.__class__(**{**dataclasses.asdict(tiny_k3().moe), "expert_intermediate_size": 40,
                                   "packed_experts": True})


def test_column_layouts_refuse_scales_past_the_compiled_decode(tmp_path, rng, monkeypatch):
    """The Mosaic GPU expert kernel's compiled decode folds each E8M0 scale into one bf16 multiply (exact up to byte
    128): a load into its layouts refuses a checkpoint past that, naming the parameter and the way out, and so does a
    conversion into them (nothing kept); the "rows" layout (the Pallas-Triton kernels, any scale) and the
    dequantising load still take it."""
    cfg = dataclasses.replace(tiny_k3(num_layers=4, attn_res_block_size=2), quantization="mxfp4")
    src = tmp_path / "big_scale"
    save_checkpoint(snap_experts_to_mxfp4(k3jax.CausalLM.random(cfg, seed=3)), src, shards=1)

    def bump(tensors):
        name = sorted(n for n in tensors if n.endswith("weight_scale"))[0]
        assert int(tensors[name].max()) <= SCALED_MAX_SCALE     # as written: real-sized weights
        tensors[name].flat[3] = SCALED_MAX_SCALE + 1
    rewrite_tensors(src, bump)
    for layout in ("columns", "handoff"):
        with pytest.raises(CheckpointError, match=rf"expert_layout='{layout}' kernel .* \(byte {SCALED_MAX_SCALE + 1}"
                                                  r"\); load with packed_experts=False or expert_layout='rows'"):
            k3jax.load(src, packed_experts=True, expert_layout=layout)
    ids = _ids(cfg, rng)
    assert_close("rows layout", k3jax.load(src, dtype="float32", packed_experts=True).logits(ids),
                 k3jax.load(src, dtype="float32").logits(ids), dtype="float32")
    for layout in ("columns", "handoff"):           # the conversion refuses it as it reads it, keeping nothing
        with pytest.raises(CheckpointError, match=rf"scale byte {SCALED_MAX_SCALE + 1}, past what the expert_layout="
                                                  rf"'{layout}' kernel .*; convert with --dequantize-experts"):
            convert(src, tmp_path / layout, dtype="float32", expert_layout=layout, progress=False)
        assert not (tmp_path / layout).exists() and not (tmp_path / f"{layout}.partial").exists()
    convert(src, tmp_path / "rows", dtype="float32", progress=False)        # the "rows" layout takes any scale
    assert k3jax.load(tmp_path / "rows").config.moe.packed_layout == "rows"
    # An interrupted conversion of a converter without the check (here one whose check is moved past the byte) is
    # not resumed by this one: the tensors it wrote were never checked.
    with monkeypatch.context() as patch:
        patch.setattr(convert_module, "SCALED_MAX_SCALE", 255)
        read, calls = convert_module.read_param_slice, []

        def read_then_stop(*args):                                   # Ctrl-C after six tensors
            calls.append(1)
            if len(calls) > 6:
                raise KeyboardInterrupt
            return read(*args)
        patch.setattr(convert_module, "read_param_slice", read_then_stop)
        with pytest.raises(KeyboardInterrupt):
            convert(src, tmp_path / "resumed", dtype="float32", expert_layout="handoff", progress=False)
    assert (tmp_path / "resumed.partial").exists()
    with pytest.raises(CheckpointError, match=r"interrupted conversion .*scale_max.*--restart"):
        convert(src, tmp_path / "resumed", dtype="float32", expert_layout="handoff", progress=False)
    with pytest.raises(CheckpointError, match=f"scale byte {SCALED_MAX_SCALE + 1}"):
        convert(src, tmp_path / "resumed", dtype="float32", expert_layout="handoff", progress=False, restart=True)
    assert not (tmp_path / "resumed").exists() and not (tmp_path / "resumed.partial").exists()
    # A converted checkpoint that holds such a byte anyway (an older converter's, here one whose check is moved
    # past the byte) is refused at load.
    monkeypatch.setattr(convert_module, "SCALED_MAX_SCALE", 255)
    convert(src, tmp_path / "converted", dtype="float32", expert_layout="handoff", progress=False)
    with pytest.raises(CheckpointError, match=r"w[123]_scale \(byte 129\); convert again with --dequantize-experts"):
        k3jax.load(tmp_path / "converted")
