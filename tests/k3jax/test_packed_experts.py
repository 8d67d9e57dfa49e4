"""Routed experts kept packed as MXFP4 on the device (`load(..., packed_experts=True)`): the same
model as the dequantising load, a quarter of the expert bytes, on one device and sharded."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from checkpoints import snap_experts_to_mxfp4
from tolerances import assert_close

import k3jax
from k3jax.checkpoint.safetensors_io import CheckpointError
from k3jax.checkpoint.writer import save_checkpoint
from k3jax.config import tiny_k3
from k3jax.errors import ConfigError
from k3jax.memory_plan import plan_memory
from k3jax.sharding import MeshSpec, make_mesh


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
