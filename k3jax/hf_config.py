"""Hugging Face `config.json` -> `ModelConfig`.

Accepts both forms a Kimi-Linear config takes in the wild (arch §1.4, §8.3):
  * the released layout: `linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`,
    `first_k_dense_replace` and `moe_layer_freq`;
  * what transformers' `save_pretrained` writes: `layer_types` ("linear_attention" /
    "full_attention") and `mlp_layer_types` ("dense" / "sparse"), plus alias keys.
A K3 wrapper (`model_type: kimi_k3`) is unwrapped to its nested `text_config`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from k3jax.config import (Activation, AttnResConfig, ConfigError, KDAConfig, MLAConfig, MLPConfig, ModelConfig,
                          MoEConfig)

# Canonical key -> accepted aliases, in order of preference.
_ALIASES = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_token": ("num_experts_per_token", "num_experts_per_tok"),
    "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "moe_renormalize": ("moe_renormalize", "norm_topk_prob"),
    "num_expert_group": ("num_expert_group", "n_group"),
    "max_position_embeddings": ("model_max_length", "max_position_embeddings"),
}

# Switches this code base does not implement: fail loudly instead of running a different model.
_UNSUPPORTED_WHEN_TRUE = ("mla_use_rope",)


def _get(cfg: Mapping[str, Any], key: str, default: Any = ConfigError) -> Any:
    for name in _ALIASES.get(key, (key,)):
        if name in cfg:
            return cfg[name]
    if default is ConfigError:
        raise ConfigError(f"invalid config field '{key}': missing from config.json")
    return default


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    if "text_config" in cfg:
        text = cfg["text_config"]
        if not isinstance(text, Mapping):
            raise ConfigError("invalid config field 'text_config': expected an object")
        return text
    return cfg


def _typed_list(cfg: Mapping[str, Any], key: str, mapping: dict, num_layers: int) -> tuple | None:
    """Reads a per-layer list of type names (transformers' form) through `mapping`, or None if absent."""
    types = cfg.get(key)
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"invalid config field '{key}': expected a list of {num_layers} entries "
                          f"(num_hidden_layers), got {types!r}")
    unknown = sorted({str(t) for t in types if t not in mapping})
    if unknown:
        raise ConfigError(f"invalid config field '{key}': unknown values {unknown}")
    return tuple(mapping[t] for t in types)


def _moe_by_rule(cfg: Mapping[str, Any], layers, has_moe: bool) -> tuple:
    """FFN kind of each global layer index by arch §1.4: MoE when num_experts is set, the index is
    >= first_k_dense_replace (transformers' default 1 when absent) and on the moe_layer_freq grid."""
    first_dense = cfg.get("first_k_dense_replace", 1)
    freq = cfg.get("moe_layer_freq", 1)
    if not isinstance(first_dense, int) or first_dense < 0:
        raise ConfigError(f"invalid config field 'first_k_dense_replace': expected an integer >= 0, "
                          f"got {first_dense!r}")
    if not isinstance(freq, int) or freq < 1:
        raise ConfigError(f"invalid config field 'moe_layer_freq': expected an integer >= 1, got {freq!r}")
    return tuple("moe" if has_moe and i >= first_dense and i % freq == 0 else "dense" for i in layers)


def _layer_plan(cfg: Mapping[str, Any], num_layers: int, has_moe: bool) -> tuple[tuple, tuple]:
    """Mixer and FFN kind per layer, following arch §1.4 exactly."""
    lin = cfg.get("linear_attn_config") or {}
    from_lists = None
    if "kda_layers" in lin or "full_attn_layers" in lin:
        kda = lin.get("kda_layers") or []
        full = lin.get("full_attn_layers") or []
        for name, layers in (("kda_layers", kda), ("full_attn_layers", full)):
            bad = [x for x in layers if not isinstance(x, int) or not 1 <= x <= num_layers]
            if bad:
                raise ConfigError(f"invalid config field 'linear_attn_config.{name}': entries {bad} are not "
                                  f"1-based layer numbers in [1, {num_layers}]")
        overlap = sorted(set(kda) & set(full))
        missing = sorted(set(range(1, num_layers + 1)) - set(kda) - set(full))
        if overlap or missing or len(kda) + len(full) != num_layers:
            raise ConfigError(
                "invalid config field 'linear_attn_config.kda_layers': kda_layers and full_attn_layers "
                f"must partition 1..{num_layers} (both: {overlap}, neither: {missing})")
        from_lists = tuple("kda" if (i + 1) in set(kda) else "mla" for i in range(num_layers))

    from_types = _typed_list(cfg, "layer_types", {"linear_attention": "kda", "full_attention": "mla"}, num_layers)

    if from_types is not None and from_lists is not None and from_types != from_lists:
        raise ConfigError("invalid config field 'layer_types': disagrees with linear_attn_config.kda_layers")
    mixers = from_types or from_lists
    if mixers is None:
        raise ConfigError("invalid config field 'layer_types': config.json has neither layer_types nor "
                          "linear_attn_config.kda_layers/full_attn_layers")

    ffns = _typed_list(cfg, "mlp_layer_types", {"dense": "dense", "sparse": "moe"}, num_layers)
    if ffns is None:
        ffns = _moe_by_rule(cfg, range(num_layers), has_moe)
    if "moe" in ffns and not has_moe:
        raise ConfigError("invalid config field 'num_experts': MoE layers are listed but num_experts is missing")
    return mixers, ffns


def _mtp_plan(cfg: Mapping[str, Any], num_layers: int, has_moe: bool) -> tuple[tuple, tuple]:
    """MTP layers L + j follow the normal typing rules (arch §7): not in kda_layers, so MLA; MoE
    when past first_k_dense_replace on the moe_layer_freq grid."""
    n = cfg.get("num_nextn_predict_layers") or 0
    if not isinstance(n, int) or n < 0:
        raise ConfigError(f"invalid config field 'num_nextn_predict_layers': expected an integer >= 0, got {n!r}")
    ffns = _moe_by_rule(cfg, range(num_layers, num_layers + n), has_moe)
    return ("mla",) * n, ffns


def _quantization(qcfg: Mapping[str, Any] | None) -> str | None:
    """compressed-tensors MXFP4 routed experts (arch §8.4) -> "mxfp4"; anything else is refused."""
    if not qcfg:
        return None
    method, fmt = qcfg.get("quant_method"), str(qcfg.get("format", ""))
    if method == "compressed-tensors" and "mxfp4" in fmt:
        for group in (qcfg.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if w and (w.get("num_bits") != 4 or w.get("type") != "float" or w.get("group_size") != 32):
                raise ConfigError("invalid config field 'quantization_config': MXFP4 weights must be 4-bit floats "
                                  f"in groups of 32, got {w}")
        return "mxfp4"
    raise ConfigError(f"invalid config field 'quantization_config': unsupported quant_method={method!r} "
                      f"format={fmt!r} (supported: compressed-tensors mxfp4-pack-quantized)")


def to_hf_config(cfg: ModelConfig) -> dict:
    """The released config.json form of `cfg` (inverse of `from_hf_config`): linear_attn_config with
    1-based layer lists; a `kimi_k3` wrapper with `text_config` for K3-layout models."""
    n = cfg.num_layers
    text: dict[str, Any] = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": n,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": False,
        "model_max_length": cfg.max_position_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if len(cfg.eos_token_id) != 1 else cfg.eos_token_id[0],
        "pad_token_id": cfg.pad_token_id, "num_nextn_predict_layers": cfg.num_mtp_layers, "mla_use_nope": True,
    }
    act = (cfg.mlp or cfg.moe).activation
    text.update(hidden_act=act.kind, intermediate_size=cfg.mlp.intermediate_size if cfg.mlp else None)
    if act.kind == "situ":
        text.update(activation_situ_beta=act.situ_beta, activation_situ_linear_beta=act.situ_linear_beta)
    if cfg.kda is not None:
        k = cfg.kda
        text["linear_attn_config"] = {
            "num_heads": k.num_heads, "head_dim": k.head_dim, "short_conv_kernel_size": k.conv_size,
            "kda_layers": [i + 1 for i, m in enumerate(cfg.mixers) if m == "kda"],
            "full_attn_layers": [i + 1 for i, m in enumerate(cfg.mixers) if m == "mla"],
            **({"gate_lower_bound": k.gate_lower_bound} if k.gate_lower_bound is not None else {}),
            **({"use_full_rank_gate": True} if k.use_full_rank_gate else {}),
        }
    else:
        text["layer_types"] = ["full_attention"] * n
    if cfg.mla is not None:
        m = cfg.mla
        text.update(num_attention_heads=m.num_heads, num_key_value_heads=m.num_heads, kv_lora_rank=m.kv_lora_rank,
                    q_lora_rank=m.q_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                    qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                    mla_use_output_gate=m.use_output_gate)
    first_dense = next((i for i, f in enumerate(cfg.ffns) if f == "moe"), n)
    if cfg.ffns == tuple("dense" if i < first_dense else "moe" for i in range(n)):
        text.update(first_k_dense_replace=first_dense, moe_layer_freq=1)
    else:
        text["mlp_layer_types"] = ["sparse" if f == "moe" else "dense" for f in cfg.ffns]
    if cfg.moe is not None:
        e = cfg.moe
        text.update(num_experts=e.num_experts, num_experts_per_token=e.num_experts_per_token,
                    num_shared_experts=e.num_shared_experts, moe_intermediate_size=e.expert_intermediate_size,
                    moe_renormalize=e.renormalize, routed_scaling_factor=e.routed_scaling_factor,
                    num_expert_group=e.num_expert_group, topk_group=e.topk_group,
                    moe_router_activation_func=e.score_function, routed_expert_hidden_size=e.latent_size,
                    latent_moe_use_norm=e.latent_use_norm)
    if cfg.attn_res is not None:
        text["attn_res_block_size"] = cfg.attn_res.block_size
    if cfg.quantization == "mxfp4":
        text["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                "dynamic": False, "scale_dtype": "torch.uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}
    if cfg.model_type == "kimi_k3":
        return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
                "bos_token_id": cfg.bos_token_id, "eos_token_id": text["eos_token_id"],
                "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": False}
    return text


def from_hf_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """Builds a `ModelConfig` from a parsed Hugging Face config.json (Kimi-Linear or K3 wrapper)."""
    outer_type = cfg.get("model_type")
    text = _text_config(cfg)
    model_type = text.get("model_type", outer_type)
    if model_type not in ("kimi_linear", "kimi_k3"):
        raise ConfigError(f"invalid config field 'model_type': expected 'kimi_linear' (or a 'kimi_k3' wrapper), "
                          f"got {model_type!r}")
    for key in _UNSUPPORTED_WHEN_TRUE:
        if text.get(key):
            raise ConfigError(f"invalid config field '{key}': not supported (K3 and Kimi-Linear MLA use no RoPE)")
    if text.get("mla_use_nope") is False:
        raise ConfigError("invalid config field 'mla_use_nope': only NoPE MLA (no rotary embedding) is supported")

    hidden = _get(text, "hidden_size")
    num_layers = _get(text, "num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"invalid config field 'num_hidden_layers': expected a positive integer, got {num_layers!r}")
    eps = _get(text, "rms_norm_eps", 1e-5)
    act = Activation(kind=_get(text, "hidden_act", "silu"),
                     situ_beta=text.get("activation_situ_beta", 1.0),
                     situ_linear_beta=text.get("activation_situ_linear_beta"))

    num_experts = _get(text, "num_experts", None)
    mixers, ffns = _layer_plan(text, num_layers, num_experts is not None)
    mtp_mixers, mtp_ffns = _mtp_plan(text, num_layers, num_experts is not None)
    block = text.get("attn_res_block_size")
    attn_res = None if block is None else AttnResConfig(block_size=block, eps=eps)

    lin = text.get("linear_attn_config") or {}
    kda = None
    if "kda" in mixers + mtp_mixers:
        kda = KDAConfig(
            hidden_size=hidden,
            num_heads=lin.get("num_heads", text.get("linear_num_heads", 32)),
            head_dim=lin.get("head_dim", text.get("linear_head_dim", 128)),
            conv_size=lin.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4)),
            norm_eps=eps,
            gate_lower_bound=lin.get("gate_lower_bound"),
            use_full_rank_gate=bool(lin.get("use_full_rank_gate", False)),
        )
    mla = None
    if "mla" in mixers + mtp_mixers:
        mla = MLAConfig(
            hidden_size=hidden,
            num_heads=_get(text, "num_attention_heads"),
            kv_lora_rank=_get(text, "kv_lora_rank"),
            qk_nope_head_dim=_get(text, "qk_nope_head_dim"),
            qk_rope_head_dim=_get(text, "qk_rope_head_dim"),
            v_head_dim=_get(text, "v_head_dim"),
            q_lora_rank=text.get("q_lora_rank"),
            use_output_gate=bool(text.get("mla_use_output_gate", False)),
        )
    mlp = MLPConfig(hidden, _get(text, "intermediate_size"), act) if "dense" in ffns + mtp_ffns else None
    moe = None
    if "moe" in ffns + mtp_ffns:
        moe = MoEConfig(
            hidden_size=hidden,
            num_experts=num_experts,
            num_experts_per_token=_get(text, "num_experts_per_token"),
            expert_intermediate_size=_get(text, "moe_intermediate_size"),
            num_shared_experts=_get(text, "num_shared_experts", 0),
            renormalize=bool(_get(text, "moe_renormalize", True)),
            routed_scaling_factor=float(_get(text, "routed_scaling_factor", 1.0)),
            num_expert_group=_get(text, "num_expert_group", 1) or 1,
            topk_group=_get(text, "topk_group", 1) or 1,
            score_function=text.get("moe_router_activation_func", "sigmoid"),
            activation=act,
            latent_size=text.get("routed_expert_hidden_size"),
            latent_use_norm=bool(text.get("latent_moe_use_norm", False)),
            norm_eps=eps,
        )

    eos = _get(text, "eos_token_id", cfg.get("eos_token_id"))
    eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
    return ModelConfig(
        vocab_size=_get(text, "vocab_size"),
        hidden_size=hidden,
        mixers=mixers,
        ffns=ffns,
        rms_norm_eps=eps,
        kda=kda,
        mla=mla,
        mlp=mlp,
        moe=moe,
        attn_res=attn_res,
        mtp_mixers=mtp_mixers,
        mtp_ffns=mtp_ffns,
        quantization=_quantization(text.get("quantization_config") or cfg.get("quantization_config")),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        max_position_embeddings=_get(text, "max_position_embeddings", 1 << 20),
        bos_token_id=_get(text, "bos_token_id", cfg.get("bos_token_id")),
        eos_token_id=eos,
        pad_token_id=_get(text, "pad_token_id", cfg.get("pad_token_id")),
        model_type=outer_type or model_type,
    )


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """Reads `<path>/config.json` (or the file itself) and builds the model config."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json at {file}")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return from_hf_config(cfg)


def read_generation_config(path: str | os.PathLike) -> dict | None:
    """The checkpoint's generation_config.json (sampling defaults) as a dict, None when absent."""
    file = os.path.join(os.fspath(path), "generation_config.json")
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return config
