"""Config parsing: both Kimi-Linear layouts, layer typing (arch §1.4), K3 nesting, clear errors."""

from __future__ import annotations

import copy
import json

import pytest

from k3jax.config import ConfigError, KDAConfig, MoEConfig, tiny_kimi_linear
from k3jax.hf_config import from_hf_config, load_hf_config

KL_KDA = [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]
KL_FULL = [4, 8, 12, 16, 20, 24, 27]

RELEASED_KIMI_LINEAR = {  # the released Kimi-Linear-48B-A3B fields (arch §1.2, §1.3)
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "num_experts": 256, "num_experts_per_token": 8,
    "num_shared_experts": 1, "moe_intermediate_size": 1024, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True, "routed_scaling_factor": 2.446, "use_grouped_topk": True, "num_expert_group": 1,
    "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "model_max_length": 1048576, "rope_theta": 10000, "tie_word_embeddings": False,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                           "full_attn_layers": KL_FULL, "kda_layers": KL_KDA},
}


def test_released_kimi_linear_layer_typing():
    cfg = from_hf_config(RELEASED_KIMI_LINEAR)
    mla = [i for i, m in enumerate(cfg.mixers) if m == "mla"]
    assert mla == [3, 7, 11, 15, 19, 23, 26]                     # arch §1.4 table, 0-based
    assert cfg.ffns == ("dense",) + ("moe",) * 26
    assert cfg.kda.num_heads == 32 and cfg.kda.head_dim == 128 and cfg.kda.gate_lower_bound is None
    assert cfg.mla.scale == pytest.approx(192 ** -0.5)
    assert cfg.mla.latent_size == 576
    assert cfg.moe.routed_scaling_factor == 2.446 and cfg.moe.num_experts == 256
    assert cfg.eos_token_id == (163586,)
    assert cfg.max_position_embeddings == 1048576


def test_preset_matches_the_released_config():
    from k3jax.config import kimi_linear_48b_a3b
    assert kimi_linear_48b_a3b() == from_hf_config(RELEASED_KIMI_LINEAR)


def test_saved_pretrained_form_gives_the_same_model():
    """transformers writes layer_types / mlp_layer_types and alias keys instead (arch §8.3)."""
    saved = {k: v for k, v in RELEASED_KIMI_LINEAR.items()
             if k not in ("linear_attn_config", "first_k_dense_replace", "moe_layer_freq", "num_experts",
                          "num_experts_per_token", "num_shared_experts", "moe_renormalize", "num_expert_group")}
    saved.update(layer_types=["linear_attention" if i + 1 in KL_KDA else "full_attention" for i in range(27)],
                 mlp_layer_types=["dense"] + ["sparse"] * 26, linear_num_heads=32, linear_head_dim=128,
                 linear_conv_kernel_dim=4, num_local_experts=256, num_experts_per_tok=8, n_shared_experts=1,
                 norm_topk_prob=True, n_group=1)
    assert from_hf_config(saved) == from_hf_config(RELEASED_KIMI_LINEAR)


def test_k3_nested_text_config_layer_plan():
    """K3's plan: 93 layers, MLA at 4k-1 and 92 (0-based), layer 0 dense (arch §1.4)."""
    text = copy.deepcopy(RELEASED_KIMI_LINEAR)
    full = list(range(4, 93, 4)) + [93]
    text.update(num_hidden_layers=93, linear_attn_config={
        "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "full_attn_layers": full,
        "kda_layers": [i for i in range(1, 94) if i not in full]})
    cfg = from_hf_config({"model_type": "kimi_k3", "text_config": text})
    mla = [i for i, m in enumerate(cfg.mixers) if m == "mla"]
    assert mla == [4 * k - 1 for k in range(1, 24)] + [92]
    assert cfg.mixers[0] == "kda" and cfg.mixers[91] == cfg.mixers[92] == "mla"
    assert cfg.model_type == "kimi_k3"


def test_first_k_dense_and_layer_frequency():
    raw = copy.deepcopy(RELEASED_KIMI_LINEAR)
    raw.update(num_hidden_layers=6, first_k_dense_replace=2, moe_layer_freq=2,
               linear_attn_config={**raw["linear_attn_config"], "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6]})
    assert from_hf_config(raw).ffns == ("dense", "dense", "moe", "dense", "moe", "dense")


@pytest.mark.parametrize("change,field", [
    (dict(linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [2, 3]}), "kda_layers"),
    (dict(linear_attn_config={"kda_layers": [0, 1], "full_attn_layers": [2, 3]}), "kda_layers"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_experts_per_token=300), "num_experts_per_token"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(num_expert_group=3), "num_expert_group"),
    (dict(model_type="llama"), "model_type"),
    (dict(attn_res_block_size=0), "attn_res_block_size"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(mla_use_rope=True), "mla_use_rope"),
    (dict(mla_use_nope=False), "mla_use_nope"),
    (dict(layer_types=["linear_attention"] * 3), "layer_types"),
    (dict(first_k_dense_replace=-1), "first_k_dense_replace"),
    (dict(eos_token_id=999999), "eos_token_id"),
])
def test_invalid_config_names_the_field(change, field):
    raw = copy.deepcopy(RELEASED_KIMI_LINEAR)
    raw["num_hidden_layers"] = 4
    raw["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4])
    for key, value in change.items():
        if key == "linear_attn_config":
            raw[key].update(value)
        else:
            raw[key] = value
    with pytest.raises(ConfigError, match=field):
        from_hf_config(raw)


def test_missing_field_and_bad_file(tmp_path):
    raw = {k: v for k, v in RELEASED_KIMI_LINEAR.items() if k != "kv_lora_rank"}
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        from_hf_config(raw)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_hf_config(tmp_path / "nowhere")


def test_sub_config_validation():
    with pytest.raises(ConfigError, match="kda.impl"):
        KDAConfig(hidden_size=8, num_heads=1, head_dim=8, impl="fast")
    with pytest.raises(ConfigError, match="topk_group"):
        MoEConfig(hidden_size=8, num_experts=8, num_experts_per_token=4, expert_intermediate_size=4,
                  num_expert_group=4, topk_group=1)
    cfg = tiny_kimi_linear()
    assert cfg.with_impls(kda="recurrent", mla="naive", moe="dense").kda.impl == "recurrent"
    json.dumps(cfg.mixers)  # plain tuples of strings
    assert KDAConfig(hidden_size=8, num_heads=1, head_dim=64, decode_split="4").decode_split == "4"
    with pytest.raises(ConfigError, match="kda.decode_split.*4 column blocks of a 32-wide head"):
        KDAConfig(hidden_size=8, num_heads=1, head_dim=32, decode_split="4")
    with pytest.raises(ConfigError, match="kda.decode_split"):
        cfg.with_impls(kda_split="2")      # the tiny model's 16-wide heads


def test_one_vocabulary_of_implementation_options():
    cfg = tiny_kimi_linear()
    changed = cfg.with_impls(kda="pallas", kda_decode="pallas", mla="pallas", moe="gather", gmm="xla")
    assert (changed.kda.impl, changed.kda.decode_impl, changed.mla.decode_impl, changed.moe.impl,
            changed.moe.gmm_impl) == ("pallas", "pallas", "pallas", "gather", "xla")
    assert cfg.with_impls(attn_res="list") == cfg  # a choice for a part the model lacks is ignored
    assert cfg.mla.prefill_impl == "auto" and cfg.with_impls(mla_prefill="naive").mla.prefill_impl == "naive"
    assert cfg.mla.merge_impl == "auto" and cfg.with_impls(mla_merge="pallas").mla.merge_impl == "pallas"
    with pytest.raises(ConfigError, match="mla.merge_impl"):
        cfg.with_impls(mla_merge="sum")
    with pytest.raises(ConfigError, match=r"mla.prefill_impl.*expected one of \('auto', 'cudnn', 'flash', 'naive'\)"):
        cfg.with_impls(mla_prefill="pallas")
    for old, new in (("kda_impl", "kda"), ("mla_impl", "mla"), ("moe_impl", "moe"), ("attn_res_impl", "attn_res")):
        with pytest.raises(ConfigError, match=f"'{old}' is now called '{new}'"):
            cfg.with_impls(**{old: "x"})
    with pytest.raises(ConfigError, match="'reference' is now called 'xla'"):
        cfg.with_impls(kda_decode="reference")
    with pytest.raises(ConfigError, match="unknown implementation option 'mlp'"):
        cfg.with_impls(mlp="dense")
    with pytest.raises(ConfigError, match=r"mla.decode_impl.*expected one of \('absorbed', 'naive', 'pallas', 'hopper'\)"):
        cfg.with_impls(mla="flash")


@pytest.mark.parametrize("head_dim,state_dtype,problem", [
    (32, "float32", "'hopper' needs a head_dim that is a multiple of 64, got 32"),
    (192, "float32", r"'hopper' at head_dim 192 \(float32 state\) needs more shared memory than one block has"),
    (256, "bfloat16", r"'hopper' at head_dim 256 \(bfloat16 state\) needs more shared memory"),
])
def test_the_hopper_kda_step_refuses_heads_it_cannot_run(head_dim, state_dtype, problem):
    """The Mosaic GPU decode step is refused at config time, not at the first decode step."""
    with pytest.raises(ConfigError, match=f"kda.decode_impl.*{problem}"):
        KDAConfig(hidden_size=64, num_heads=2, head_dim=head_dim, decode_impl="hopper", state_dtype=state_dtype)
    for ok in ((128, "float32"), (192, "bfloat16"), (64, "float32")):
        assert KDAConfig(hidden_size=64, num_heads=2, head_dim=ok[0], decode_impl="hopper", state_dtype=ok[1])


def _tiny_released(**changes) -> dict:
    raw = copy.deepcopy(RELEASED_KIMI_LINEAR)
    raw["num_hidden_layers"] = 4
    raw["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4])
    raw.update(changes)
    return raw


@pytest.mark.parametrize("change,field", [
    (dict(num_attention_heads="32"), "num_attention_heads"),
    (dict(hidden_size=[2304]), "hidden_size"),
    (dict(num_hidden_layers=4.0), "num_hidden_layers"),
    (dict(rms_norm_eps="1e-5"), "rms_norm_eps"),
    (dict(routed_scaling_factor="2.4"), "routed_scaling_factor"),
    (dict(topk_group="1"), "topk_group"),
    (dict(eos_token_id=["2"]), "eos_token_id"),
    (dict(bos_token_id=[1]), "bos_token_id"),
    (dict(model_max_length="long"), "model_max_length"),
    (dict(linear_attn_config=[1, 2]), "linear_attn_config"),
    (dict(linear_attn_config={"kda_layers": 3, "full_attn_layers": [4]}), "kda_layers"),
    (dict(linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "gate_lower_bound": "-5"}),
     "gate_lower_bound"),
    (dict(layer_types=[["linear_attention"]] * 4, linear_attn_config=None), "layer_types"),
    (dict(hidden_act=["silu"]), "hidden_act"),
    (dict(quantization_config={"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                               "config_groups": {"group_0": None}}), "quantization_config"),
    (dict(quantization_config=["mxfp4"]), "quantization_config"),
    (dict(num_hidden_layers=10 ** 9), "num_hidden_layers"),
    (dict(num_nextn_predict_layers=10 ** 9), "num_nextn_predict_layers"),
    (dict(activation_situ_beta="4", hidden_act="situ"), "activation_situ_beta"),
])
def test_wrong_types_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field) as err:
        from_hf_config(_tiny_released(**change))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("raw", [None, [1, 2], "kimi_linear"])
def test_config_that_is_not_an_object(raw):
    with pytest.raises(ConfigError, match="expected a JSON object"):
        from_hf_config(raw)
