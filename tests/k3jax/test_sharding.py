"""Sharding and expert parallelism on 8 fake CPU devices: every layout equals one device."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

import k3jax
from k3jax.config import ExpertParallel
from k3jax.sharding import MeshSpec, config_for_mesh, logical_spec, make_mesh

MESHES = [MeshSpec(expert=8), MeshSpec(data=2, expert=4), MeshSpec(tensor=8)]


def test_eight_devices():
    assert len(jax.devices()) == 8




@pytest.fixture(scope="module", params=["kimi_linear", "k3"])
def base_model(request):
    # Every layer kind (KDA and MLA, dense and MoE; K3: two AttnRes blocks and MTP) in few layers.
    cfg = k3jax.tiny_kimi_linear(num_layers=2) if request.param == "kimi_linear" else k3jax.tiny_k3(
        num_layers=4, attn_res_block_size=2)
    return k3jax.CausalLM.random(cfg, seed=7)


@pytest.fixture(scope="module")
def base_generator(base_model):
    """One device's generation, compiled once for the meshes' cases."""
    return k3jax.Generator(base_model)


@pytest.mark.parametrize("spec", MESHES, ids=lambda s: f"d{s.data}e{s.expert}t{s.tensor}")
def test_sharded_model_equals_single_device(base_model, base_generator, rng, spec):
    ids = rng.integers(3, 512, (4, 10))
    mesh = make_mesh(spec)
    sharded = base_model.shard(mesh)
    w1 = sharded.params["model"]["layers"][1]["block_sparse_moe"]["experts"]["w1"][...]
    assert w1.sharding.spec[0] == ("expert" if spec.expert > 1 else None)
    # Expert parallelism is part of the config, on exactly when the mesh has an expert axis.
    ep = sharded.config.moe.expert_parallel
    assert ep == (ExpertParallel(spec.expert, spec.data) if spec.expert > 1 else None)
    assert base_model.config.moe.expert_parallel is None
    if spec.tensor > 1:
        assert sharded.params["lm_head"]["kernel"][...].sharding.spec == P(None, "tensor")
    assert_close("logits", sharded.logits(ids), base_model.logits(ids))
    # Generation with the decode-sized expert path ("auto" gathers for few tokens) inside the
    # expert-parallel body.
    sharded_auto = sharded.with_impls(moe="auto")
    assert sharded_auto.config.moe.expert_parallel == ep and sharded_auto.config.moe.impl == "auto"
    sp = k3jax.SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [ids[0].tolist(), ids[1, :7].tolist()]
    ours = [r.token_ids for r in k3jax.Generator(sharded_auto).generate(prompts, sp)]
    ref = [r.token_ids for r in base_generator.generate(prompts, sp)]
    assert ours == ref


def test_built_and_loaded_straight_into_the_mesh(oracle_dir, rng):
    mesh = make_mesh(MeshSpec(data=2, expert=4))
    built = k3jax.CausalLM.random(k3jax.tiny_kimi_linear(), seed=3, mesh=mesh)
    assert built.params["model"]["layers"][2]["block_sparse_moe"]["experts"]["w2"][...].sharding.spec[0] == "expert"
    plain = k3jax.CausalLM.random(k3jax.tiny_kimi_linear(), seed=3)
    ids = rng.integers(3, 512, (2, 9))
    assert_close("random(mesh=...)", built.logits(ids), plain.logits(ids))
    ref = np.load(oracle_dir / "hf" / "kl_alt" / "reference.npz")
    loaded = k3jax.load(oracle_dir / "hf" / "kl_alt", mesh=mesh)
    assert loaded.params["model"]["layers"][1]["block_sparse_moe"]["experts"]["w3"][...].sharding.spec[0] == "expert"
    assert_close("loaded into the mesh", loaded.logits(ref["input_ids"]), ref["full_logits"], tol=1e-4)


def test_rules_and_mesh_spec():
    mesh = make_mesh(MeshSpec(data=2, expert=2, tensor=2))
    assert logical_spec(("embed", "kda_proj"), (64, 64), mesh) == P(None, "tensor")
    assert logical_spec(("experts", "embed", "expert_mlp"), (8, 64, 32), mesh) == P("expert", None, None)
    assert logical_spec(("embed", "kda_heads"), (64, 3), mesh) == P(None, None)  # 3 heads do not split in 2
    assert MeshSpec.parse("data=2,expert=4") == MeshSpec(data=2, expert=4)
    with pytest.raises(ValueError, match="bad mesh spec"):
        MeshSpec.parse("pipeline=2")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(MeshSpec(data=4, expert=4))


def test_tensor_axis_turns_whole_weight_kernels_off():
    """Kernels that read whole weights (few-row projections, MLA absorb, the shared expert as a pair)
    are not chosen on a mesh with a tensor axis, whatever was asked; without one, choices stay."""
    cfg = k3jax.tiny_kimi_linear().with_impls(linear="pallas", mla_absorb="pallas", shared="auto")
    on_tensor = config_for_mesh(cfg, make_mesh(MeshSpec(data=4, tensor=2)))
    assert (on_tensor.linear_impl, on_tensor.mla.absorb_impl, on_tensor.moe.shared_impl) == ("xla", "xla", "mlp")
    on_data = config_for_mesh(cfg, make_mesh(MeshSpec(data=8)))
    assert (on_data.linear_impl, on_data.mla.absorb_impl, on_data.moe.shared_impl) == ("pallas", "pallas", "auto")
