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
import math
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

# Bounds the per-layer tables built while parsing; far above any Kimi model (K3: 93 layers).
_MAX_LAYERS = 4096

# Switches this code base does not implement: fail loudly instead of running a different model.
_UNSUPPORTED_WHEN_TRUE = ("mla_use_rope",)


def _name(cfg: Mapping[str, Any], key: str) -> str:
    """The name `key` has in `cfg`: the first of its aliases that is set (not null)."""
    return next((name for name in _ALIASES.get(key, (key,)) if cfg.get(name) is not None), key)


def _get(cfg: Mapping[str, Any], key: str, default: Any = ConfigError) -> Any:
    """cfg[key] through its aliases; `default` when absent or null (a required field has none)."""
    name = _name(cfg, key)
    if cfg.get(name) is not None:
        return cfg[name]
    if default is ConfigError:
        raise ConfigError(f"invalid config field '{key}': missing from config.json")
    return default


def _shown(value: Any) -> str:
    """repr of a config value, cut short (a hostile config can hold anything)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(cfg: Mapping[str, Any], key: str, default: Any = ConfigError, *, minimum: int = 0,
         maximum: int | None = None, field: str | None = None) -> int | None:
    """An integer field in [minimum, maximum] (None only as the default)."""
    value = _get(cfg, key, default)
    if value is None and default is None:
        return None
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise ConfigError(f"invalid config field '{field or _name(cfg, key)}': expected an integer {bounds}, "
                          f"got {_shown(value)}")
    return value


def _float(cfg: Mapping[str, Any], key: str, default: Any = ConfigError, *, field: str | None = None) -> float | None:
    """A finite number field (None only as the default)."""
    value = _get(cfg, key, default)
    if value is None and default is None:
        return None
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        raise ConfigError(f"invalid config field '{field or _name(cfg, key)}': expected a finite number, "
                          f"got {_shown(value)}")
    return float(value)


def _typed(cfg: Mapping[str, Any], key: str, kind: type, default: Any, *, field: str | None = None) -> Any:
    """A field of one JSON type (bool, str, dict, list); None only as the default."""
    value = _get(cfg, key, default)
    if value is None and default is None:
        return None
    if not isinstance(value, kind):
        names = {bool: "true or false", str: "a string", dict: "an object", list: "a list"}
        raise ConfigError(f"invalid config field '{field or _name(cfg, key)}': expected {names[kind]}, "
                          f"got {_shown(value)}")
    return value


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
                          f"(num_hidden_layers), got {_shown(types)}")
    unknown = sorted({_shown(t) for t in types if not isinstance(t, str) or t not in mapping})
    if unknown:
        raise ConfigError(f"invalid config field '{key}': unknown values {', '.join(unknown)}")
    return tuple(mapping[t] for t in types)


def _moe_by_rule(cfg: Mapping[str, Any], layers, has_moe: bool) -> tuple:
    """FFN kind of each global layer index by arch §1.4: MoE when num_experts is set, the index is
    >= first_k_dense_replace (transformers' default 1 when absent) and on the moe_layer_freq grid."""
    first_dense = _int(cfg, "first_k_dense_replace", 1)
    freq = _int(cfg, "moe_layer_freq", 1, minimum=1)
    return tuple("moe" if has_moe and i >= first_dense and i % freq == 0 else "dense" for i in layers)


def _layer_plan(cfg: Mapping[str, Any], num_layers: int, has_moe: bool) -> tuple[tuple, tuple]:
    """Mixer and FFN kind per layer, following arch §1.4 exactly."""
    lin = _typed(cfg, "linear_attn_config", dict, {})
    from_lists = None
    if "kda_layers" in lin or "full_attn_layers" in lin:
        kda = _typed(lin, "kda_layers", list, [], field="linear_attn_config.kda_layers")
        full = _typed(lin, "full_attn_layers", list, [], field="linear_attn_config.full_attn_layers")
        for name, layers in (("kda_layers", kda), ("full_attn_layers", full)):
            bad = [x for x in layers if not _is_int(x) or not 1 <= x <= num_layers]
            if bad:
                raise ConfigError(f"invalid config field 'linear_attn_config.{name}': entries {_shown(bad)} are "
                                  f"not 1-based layer numbers in [1, {num_layers}]")
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
    n = _int(cfg, "num_nextn_predict_layers", 0, maximum=_MAX_LAYERS)
    ffns = _moe_by_rule(cfg, range(num_layers, num_layers + n), has_moe)
    return ("mla",) * n, ffns


def _quantization(qcfg: Any) -> str | None:
    """compressed-tensors MXFP4 routed experts (arch §8.4) -> "mxfp4"; anything else is refused."""
    if not qcfg:
        return None
    field = "quantization_config"
    if not isinstance(qcfg, Mapping):
        raise ConfigError(f"invalid config field '{field}': expected an object, got {_shown(qcfg)}")
    method, fmt = qcfg.get("quant_method"), str(qcfg.get("format", ""))
    if method == "compressed-tensors" and "mxfp4" in fmt:
        groups = _typed(qcfg, "config_groups", dict, {}, field=f"{field}.config_groups")
        for name, group in groups.items():
            if not isinstance(group, Mapping):
                raise ConfigError(f"invalid config field '{field}.config_groups.{name}': expected an object, "
                                  f"got {_shown(group)}")
            w = _typed(group, "weights", dict, {}, field=f"{field}.config_groups.{name}.weights")
            if w and (w.get("num_bits") != 4 or w.get("type") != "float" or w.get("group_size") != 32):
                raise ConfigError(f"invalid config field '{field}': MXFP4 weights must be 4-bit floats "
                                  f"in groups of 32, got {_shown(w)}")
        return "mxfp4"
    raise ConfigError(f"invalid config field '{field}': unsupported quant_method={_shown(method)} "
                      f"format={_shown(fmt)} (supported: compressed-tensors mxfp4-pack-quantized)")


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


def _activation(text: Mapping[str, Any]) -> Activation:
    return Activation(kind=_typed(text, "hidden_act", str, "silu"),
                      situ_beta=_float(text, "activation_situ_beta", 1.0),
                      situ_linear_beta=_float(text, "activation_situ_linear_beta", None))


def _kda_config(text: Mapping[str, Any], hidden: int, eps: float) -> KDAConfig:
    lin = _typed(text, "linear_attn_config", dict, {})
    field = "linear_attn_config.{}".format
    return KDAConfig(
        hidden_size=hidden,
        num_heads=_int(lin, "num_heads", _int(text, "linear_num_heads", 32, minimum=1), minimum=1,
                       field=field("num_heads")),
        head_dim=_int(lin, "head_dim", _int(text, "linear_head_dim", 128, minimum=1), minimum=1,
                      field=field("head_dim")),
        conv_size=_int(lin, "short_conv_kernel_size", _int(text, "linear_conv_kernel_dim", 4, minimum=1),
                       minimum=1, field=field("short_conv_kernel_size")),
        norm_eps=eps,
        gate_lower_bound=_float(lin, "gate_lower_bound", None, field=field("gate_lower_bound")),
        use_full_rank_gate=_typed(lin, "use_full_rank_gate", bool, False, field=field("use_full_rank_gate")),
    )


def _mla_config(text: Mapping[str, Any], hidden: int) -> MLAConfig:
    return MLAConfig(
        hidden_size=hidden,
        num_heads=_int(text, "num_attention_heads", minimum=1),
        kv_lora_rank=_int(text, "kv_lora_rank", minimum=1),
        qk_nope_head_dim=_int(text, "qk_nope_head_dim", minimum=1),
        qk_rope_head_dim=_int(text, "qk_rope_head_dim"),
        v_head_dim=_int(text, "v_head_dim", minimum=1),
        q_lora_rank=_int(text, "q_lora_rank", None, minimum=1),
        use_output_gate=_typed(text, "mla_use_output_gate", bool, False),
    )


def _moe_config(text: Mapping[str, Any], hidden: int, num_experts: int, act: Activation, eps: float) -> MoEConfig:
    return MoEConfig(
        hidden_size=hidden,
        num_experts=num_experts,
        num_experts_per_token=_int(text, "num_experts_per_token", minimum=1),
        expert_intermediate_size=_int(text, "moe_intermediate_size", minimum=1),
        num_shared_experts=_int(text, "num_shared_experts", 0),
        renormalize=_typed(text, "moe_renormalize", bool, True),
        routed_scaling_factor=_float(text, "routed_scaling_factor", 1.0),
        num_expert_group=_int(text, "num_expert_group", 1) or 1,
        topk_group=_int(text, "topk_group", 1) or 1,
        score_function=_typed(text, "moe_router_activation_func", str, "sigmoid"),
        activation=act,
        latent_size=_int(text, "routed_expert_hidden_size", None, minimum=1),
        latent_use_norm=_typed(text, "latent_moe_use_norm", bool, False),
        norm_eps=eps,
    )


def _token_ids(text: Mapping[str, Any], outer: Mapping[str, Any]) -> tuple[int | None, tuple[int, ...], int | None]:
    """(bos, eos ids, pad): the text config's, else the wrapper's."""
    bos = _int(text, "bos_token_id", _int(outer, "bos_token_id", None))
    pad = _int(text, "pad_token_id", _int(outer, "pad_token_id", None))
    eos = _get(text, "eos_token_id", outer.get("eos_token_id"))
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    if not all(_is_int(t) for t in eos):
        raise ConfigError(f"invalid config field 'eos_token_id': expected an integer or a list of integers, "
                          f"got {_shown(list(eos))}")
    return bos, eos, pad


def from_hf_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """Builds a `ModelConfig` from a parsed Hugging Face config.json (Kimi-Linear or K3 wrapper).
    Raises ConfigError naming the field for anything missing, mis-typed or inconsistent."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"invalid config: expected a JSON object, got {type(cfg).__name__}")
    outer_type = cfg.get("model_type")
    text = _text_config(cfg)
    model_type = text.get("model_type", outer_type)
    if model_type not in ("kimi_linear", "kimi_k3") or not isinstance(outer_type, (str, type(None))):
        raise ConfigError(f"invalid config field 'model_type': expected 'kimi_linear' (or a 'kimi_k3' wrapper), "
                          f"got {_shown(outer_type or model_type)}")
    for key in _UNSUPPORTED_WHEN_TRUE:
        if text.get(key):
            raise ConfigError(f"invalid config field '{key}': not supported (K3 and Kimi-Linear MLA use no RoPE)")
    if text.get("mla_use_nope") is False:
        raise ConfigError("invalid config field 'mla_use_nope': only NoPE MLA (no rotary embedding) is supported")

    hidden = _int(text, "hidden_size", minimum=1)
    num_layers = _int(text, "num_hidden_layers", minimum=1, maximum=_MAX_LAYERS)
    eps = _float(text, "rms_norm_eps", 1e-5)
    act = _activation(text)

    num_experts = _int(text, "num_experts", None, minimum=1)
    mixers, ffns = _layer_plan(text, num_layers, num_experts is not None)
    mtp_mixers, mtp_ffns = _mtp_plan(text, num_layers, num_experts is not None)
    block = _int(text, "attn_res_block_size", None, minimum=1)
    kinds = mixers + mtp_mixers + ffns + mtp_ffns
    bos, eos, pad = _token_ids(text, cfg)
    return ModelConfig(
        vocab_size=_int(text, "vocab_size", minimum=1),
        hidden_size=hidden,
        mixers=mixers,
        ffns=ffns,
        rms_norm_eps=eps,
        kda=_kda_config(text, hidden, eps) if "kda" in kinds else None,
        mla=_mla_config(text, hidden) if "mla" in kinds else None,
        mlp=MLPConfig(hidden, _int(text, "intermediate_size", minimum=1), act) if "dense" in kinds else None,
        moe=_moe_config(text, hidden, num_experts, act, eps) if "moe" in kinds else None,
        attn_res=None if block is None else AttnResConfig(block_size=block, eps=eps),
        mtp_mixers=mtp_mixers,
        mtp_ffns=mtp_ffns,
        quantization=_quantization(text.get("quantization_config") or cfg.get("quantization_config")),
        tie_word_embeddings=_typed(text, "tie_word_embeddings", bool, _typed(cfg, "tie_word_embeddings", bool, False)),
        max_position_embeddings=_int(text, "max_position_embeddings", 1 << 20, minimum=1),
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        model_type=outer_type or model_type,
    )


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """Reads `<path>/config.json` (or the file itself) and builds the model config."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json at {file}")
    if not os.path.isfile(file):
        raise ConfigError(f"{file}: not a regular file")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, nesting too deep
        raise ConfigError(f"{file}: not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
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
