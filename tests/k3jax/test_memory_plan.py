"""The memory planner (k3jax.memory_plan, `k3jax plan`): its per-device bytes equal what a model
and a decode state really occupy, unsharded and on a mesh of the 8 fake CPU devices; the presets
match the published sizes; `load` refuses weights that cannot fit before reading a tensor."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from checkpoints import builtin_model

import k3jax
from k3jax.cli import main
from k3jax.config import kimi_k3, kimi_linear_48b_a3b, tiny_k3
from k3jax.memory_plan import GB, plan_memory, state_bytes, weight_bytes
from k3jax.sharding import MeshSpec, make_mesh


def _largest_shard(tree) -> int:
    """Bytes on the most loaded device of a pytree of (possibly sharded) arrays."""
    per_device: dict = {}
    for leaf in (x for x in __import__("jax").tree.leaves(tree) if hasattr(x, "addressable_shards")):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


@pytest.mark.parametrize("spec", [MeshSpec(), MeshSpec(expert=4, tensor=2), MeshSpec(data=2, tensor=4)])
def test_weights_and_state_equal_the_real_arrays(spec):
    cfg = tiny_k3(num_layers=4, attn_res_block_size=2)   # KDA, MLA, dense and MoE layers, MTP: every kind
    mesh = None if spec.size == 1 else make_mesh(spec, __import__("jax").devices()[:spec.size])
    model = k3jax.CausalLM.random(cfg, seed=0, mesh=mesh)
    weights, experts = weight_bytes(cfg, spec, "float32")
    assert weights == _largest_shard(model.params)
    assert 0 < experts < weights
    state = model.init_state(4, 192)
    kda, mla = state_bytes(cfg, spec, 4, 192, "float32")
    kda_real = _largest_shard([layer for layer in state.layers if hasattr(layer, "recurrent")])
    mla_real = _largest_shard([layer for layer in state.layers if hasattr(layer, "latent")])
    assert (kda, mla) == (kda_real, mla_real)


def test_presets_match_the_published_sizes():
    weights, experts = weight_bytes(kimi_linear_48b_a3b(), MeshSpec(), "bfloat16")
    assert 97e9 < weights < 99e9                                    # ~49B parameters in bf16
    k3_weights, k3_experts = weight_bytes(kimi_k3(), MeshSpec(), "bfloat16")
    assert 2.75e12 < k3_weights / 2 < 2.85e12                       # "2.8T total"
    assert abs(k3_experts / 2 - 92 * 896 * 3 * 3584 * 3072) < 1e6   # arch §1.5
    split = weight_bytes(kimi_k3(), MeshSpec(expert=32), "bfloat16")[1]
    assert split == k3_experts // 32


def test_plan_totals_and_fit():
    plan = plan_memory(kimi_linear_48b_a3b(), MeshSpec(), batch=64, context=4096, dtype="bfloat16")
    assert plan.total == plan.weights + plan.kda_state + plan.mla_cache + plan.activations and plan.fits
    assert plan.routed_experts_mxfp4 == int(plan.routed_experts / 2 * 4.25 / 8)
    big = plan_memory(kimi_k3(), MeshSpec(expert=8), batch=1, context=4096, dtype="bfloat16")
    assert not big.fits and any("MXFP4" in n for n in big.notes)
    with pytest.raises(ValueError, match="must be positive"):
        plan_memory(tiny_k3(), MeshSpec(), batch=0, context=8)


def test_cli_prints_the_plan_and_exits_by_fit(capsys):
    assert main(["plan", "--model", "kimi-linear-48b", "--batch", "64", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "98.25 GB" in out and "fits" in out
    assert main(["plan", "--model", "k3", "--mesh", "expert=8"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["plan", "--model", "tiny-k3-random", "--mesh", "tensor=3,bogus=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad mesh spec" in err
    assert main(["plan", "--model", "/no/such/dir"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_load_refuses_weights_that_cannot_fit(tmp_path, monkeypatch):
    from k3jax.checkpoint import loader
    from k3jax.checkpoint.writer import save_checkpoint
    cfg = tiny_k3(num_layers=4, attn_res_block_size=2)
    save_checkpoint(k3jax.CausalLM.random(cfg, seed=1), str(tmp_path / "ck"))
    read = []
    monkeypatch.setattr(loader, "device_capacity", lambda device: 1000)
    monkeypatch.setattr(loader, "read_param_slice", lambda *a, **k: read.append(a) or np.zeros(1))
    with pytest.raises(ValueError, match=r"weights need .* GB per device .* a device holds 0.0 GB"):
        k3jax.load(tmp_path / "ck")
    assert not read                                     # refused before any tensor was read
    monkeypatch.setattr(loader, "device_capacity", lambda device: 100 * GB)
    monkeypatch.undo()
    assert k3jax.load(tmp_path / "ck").config.num_layers == cfg.num_layers


def test_generate_refuses_prompts_whose_state_cannot_fit(monkeypatch):
    """Prompts are refused for memory (with the numbers), not for length, where the device memory is
    known; on the CPU it is not, and nothing is refused."""
    gen = importlib.import_module("k3jax.generate")   # the module (k3jax.generate is also the function)
    model = builtin_model("tiny-k3-random", 4)
    params = k3jax.SamplingParams(max_tokens=4)
    weights = weight_bytes(model.config, MeshSpec(), "float32")[0]
    monkeypatch.setattr(gen, "device_capacity", lambda device: weights + 1000)
    with pytest.raises(ValueError, match=r"do not fit one device: weights .* GB \+ KDA state .* MLA cache .* > "):
        k3jax.generate(model, [[5] * 40], params)
    monkeypatch.setattr(gen, "device_capacity", lambda device: 100 * GB)
    assert len(k3jax.generate(model, [[5] * 40], params).results[0].outputs[0].token_ids) == 4
