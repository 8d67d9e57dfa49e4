"""The K3 checkpoint layout: MXFP4 against an ml_dtypes decoder, round trips of the real layout
(sharded, with and without MXFP4, vision tensors skipped), A_log policies, and the HF oracle
through the K3 layout."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoints import snap_experts_to_mxfp4
from tolerances import assert_close

import k3jax
from k3jax.checkpoint.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3jax.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint, write_safetensors
from k3jax.checkpoint.writer import save_checkpoint
from k3jax.config import tiny_k3


def mldtypes_dequantize(packed, scale):
    """Independent MXFP4 decoder built on ml_dtypes' float4_e2m1fn and float8_e8m0fnu."""
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1).astype(np.uint8)
    values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    factors = scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return values * np.repeat(factors, 32, axis=1)



def test_mxfp4_matches_ml_dtypes_decoder(rng):
    packed = rng.integers(0, 256, (24, 64), dtype=np.uint8)
    scale = rng.integers(100, 140, (24, 4), dtype=np.uint8)
    ours = dequantize_mxfp4(packed, scale)
    np.testing.assert_array_equal(ours, mldtypes_dequantize(packed, scale))
    assert (np.signbit(ours) & (ours == 0)).any()  # negative zero codes exist and decode as -0.0
    again_packed, again_scale = quantize_mxfp4(ours)
    np.testing.assert_array_equal(dequantize_mxfp4(again_packed, again_scale), ours)
    with pytest.raises(ValueError, match="E8M0 NaN"):
        dequantize_mxfp4(packed, np.full_like(scale, 255))



@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_real_k3_layout_round_trip(tmp_path, rng, quantization):
    cfg = dataclasses.replace(tiny_k3(num_layers=4, attn_res_block_size=2), quantization=quantization)
    model = k3jax.CausalLM.random(cfg, seed=2)
    if quantization:
        model = snap_experts_to_mxfp4(model)
    vision = {"vision_tower.blocks.0.weight": np.ones((4, 4), np.float32),
              "mm_projector.proj.0.weight": np.ones((2, 2), np.float32)}
    save_checkpoint(model, tmp_path / "k3", shards=3, extra_tensors=vision)

    raw = json.loads((tmp_path / "k3" / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and raw["text_config"]["attn_res_block_size"] == 2
    ckpt = SafetensorsCheckpoint(tmp_path / "k3")
    assert (tmp_path / "k3" / "model.safetensors.index.json").exists()
    assert "language_model.lm_head.weight" in ckpt.tensors
    assert "language_model.model.layers.4.shared_head.head.weight" in ckpt.tensors  # the MTP layer L + 0
    if quantization:
        name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2"
        packed, scale = ckpt.read(name + ".weight_packed"), ckpt.read(name + ".weight_scale")
        assert packed.dtype == np.uint8 and packed.shape == (32, 16) and scale.shape == (32, 1)
        stored = mldtypes_dequantize(packed, scale)
        w2 = np.asarray(model.params["model"]["layers"][1]["block_sparse_moe"]["experts"]["w2"][...])[3]
        np.testing.assert_array_equal(stored, w2.T)

    loaded = k3jax.load(tmp_path / "k3")
    assert loaded.load_report.skipped == 2
    assert loaded.config.quantization == quantization
    ids = rng.integers(0, 512, (2, 9))
    assert_close("logits", loaded.logits(ids), model.logits(ids), tol=1e-6)
    h = rng.standard_normal((2, 9, 64)).astype(np.float32)
    assert_close("mtp", loaded.mtp(h, ids)[1], model.mtp(h, ids)[1], tol=1e-6)

    bf16 = k3jax.load(tmp_path / "k3", dtype="bfloat16")
    stored_bf16 = k3jax.CausalLM.random(cfg, seed=2, dtype="bfloat16")  # and a checkpoint stored in bf16
    if quantization:
        stored_bf16 = snap_experts_to_mxfp4(stored_bf16)
    save_checkpoint(stored_bf16, tmp_path / "k3_bf16")
    assert_close("bf16 checkpoint", k3jax.load(tmp_path / "k3_bf16", dtype="bfloat16").logits(ids),
                 stored_bf16.logits(ids), tol=0.0)
    kda = bf16.module.model.layers[0].self_attn
    assert kda.A_log[...].dtype == jnp.float32 and kda.dt_bias[...].dtype == jnp.float32
    assert kda.q_conv1d[...].dtype == jnp.float32 and kda.o_norm.weight[...].dtype == jnp.float32
    assert bf16.module.model.layers[1].block_sparse_moe.gate.e_score_correction_bias[...].dtype == jnp.float32
    assert kda.q_proj.kernel[...].dtype == jnp.bfloat16



def test_a_log_policies_and_short_a_log(tmp_path, rng):
    cfg = tiny_k3(num_layers=4, attn_res_block_size=2, num_mtp_layers=0)
    model = k3jax.CausalLM.random(cfg, seed=4)
    save_checkpoint(model, tmp_path / "ck")
    h, k = cfg.kda.num_heads, cfg.kda.head_dim
    kda_layers = [i for i, m in enumerate(cfg.mixers) if m == "kda"]
    a_logs = {i: np.asarray(model.params["model"]["layers"][i]["self_attn"]["A_log"][...]) for i in kda_layers}

    def rewrite(make):
        ckpt = SafetensorsCheckpoint(tmp_path / "ck")
        tensors = {n: ckpt.read(n) for n in ckpt.names()}
        for i in kda_layers:
            tensors[f"language_model.model.layers.{i}.self_attn.A_log"] = make(a_logs[i])
        write_safetensors(tmp_path / "ck" / "model.safetensors", tensors)

    # As released: more entries than heads (K3 stores [128] for 96 heads).
    extra = rng.standard_normal(k - h).astype(np.float32)
    rewrite(lambda a: np.concatenate([a, extra]))
    ids = rng.integers(0, 512, (1, 8))
    per_head = k3jax.load(tmp_path / "ck")
    assert_close("per_head reads the first H entries", per_head.logits(ids), model.logits(ids), tol=1e-6)
    per_channel = k3jax.load(tmp_path / "ck", a_log_policy="per_channel")
    np.testing.assert_array_equal(per_channel.params["model"]["layers"][0]["self_attn"]["A_log"][...],
                                  np.concatenate([a_logs[0], extra]))
    assert np.abs(np.asarray(per_channel.logits(ids)) - np.asarray(model.logits(ids))).max() > 1e-4

    rewrite(lambda a: a[:2])
    with pytest.raises(CheckpointError, match=r"A_log \[2\] \(expected \[1, 1, 4, 1\] or longer"):
        k3jax.load(tmp_path / "ck")



def test_kimi_linear_in_k3_layout_equals_hf(oracle_dir, tmp_path):
    """Every K3 feature switched off by config: the K3 code path is still the HF oracle."""
    src = oracle_dir / "hf" / "kl_alt"
    ref = np.load(src / "reference.npz")
    text = json.loads((src / "config.json").read_text())
    text.update(attn_res_block_size=None, routed_expert_hidden_size=None, latent_moe_use_norm=False,
                mla_use_output_gate=False, num_nextn_predict_layers=0)
    (tmp_path / "k3").mkdir()
    (tmp_path / "k3" / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": text}))
    ckpt = SafetensorsCheckpoint(src)
    tensors = {"language_model." + n: ckpt.read(n) for n in ckpt.names()}
    tensors["vision_tower.patch_embed.weight"] = np.zeros((3, 3), np.float32)
    write_safetensors(tmp_path / "k3" / "model.safetensors", tensors)
    model = k3jax.load(tmp_path / "k3")
    assert model.config.model_type == "kimi_k3" and model.load_report.skipped == 1
    assert_close("K3 layout vs HF", model.logits(ref["input_ids"]), ref["full_logits"], tol=1e-4)

