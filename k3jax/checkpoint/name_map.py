"""The one place that knows checkpoint tensor names: Hugging Face / Moonshot name -> parameter
path (+ expert index) + transform hook, generated from the model config (arch §8).

Layer suffix tables below are declarative; `tensor_rules` expands them per layer kind, for the
Kimi-Linear layout (`model.`, `lm_head.`) and the K3 layout (`language_model.model.`,
`language_model.lm_head.`, vision tower skipped).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from k3jax.config import COLUMN_LAYOUTS, ModelConfig


@dataclass(frozen=True)
class TensorRule:
    """Where one checkpoint tensor goes: `path` in the parameter tree (stacked experts: `expert`
    indexes the leading axis) after the transform `hook`. An MXFP4 packed tensor names its
    `partner` scale tensor."""

    path: tuple
    hook: str
    expert: int | None = None
    partner: str | None = None


# (checkpoint suffix, parameter sub-path, hook). Linear weights are stored [out, in] and kept [in, out].
_NORMS = [
    ("input_layernorm.weight", ("input_layernorm", "weight"), "copy"),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), "copy"),
]
_ATTN_RES = [
    ("self_attention_res_norm.weight", ("self_attention_res", "norm", "weight"), "copy"),
    ("self_attention_res_proj.weight", ("self_attention_res", "proj", "kernel"), "transpose"),
    ("mlp_res_norm.weight", ("mlp_res", "norm", "weight"), "copy"),
    ("mlp_res_proj.weight", ("mlp_res", "proj", "kernel"), "transpose"),
]
_KDA = [
    ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), "transpose"),
    ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), "transpose"),
    ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), "transpose"),
    ("self_attn.q_conv1d.weight", ("self_attn", "q_conv1d"), "conv"),
    ("self_attn.k_conv1d.weight", ("self_attn", "k_conv1d"), "conv"),
    ("self_attn.v_conv1d.weight", ("self_attn", "v_conv1d"), "conv"),
    ("self_attn.f_a_proj.weight", ("self_attn", "f_a_proj", "kernel"), "transpose"),
    ("self_attn.f_b_proj.weight", ("self_attn", "f_b_proj", "kernel"), "transpose"),
    ("self_attn.b_proj.weight", ("self_attn", "b_proj", "kernel"), "transpose"),
    ("self_attn.dt_bias", ("self_attn", "dt_bias"), "copy"),
    ("self_attn.o_norm.weight", ("self_attn", "o_norm", "weight"), "copy"),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), "transpose"),
]
_KDA_LOW_RANK_GATE = [
    ("self_attn.g_a_proj.weight", ("self_attn", "g_a_proj", "kernel"), "transpose"),
    ("self_attn.g_b_proj.weight", ("self_attn", "g_b_proj", "kernel"), "transpose"),
]
_KDA_FULL_RANK_GATE = [("self_attn.g_proj.weight", ("self_attn", "g_proj", "kernel"), "transpose")]
_MLA = [
    ("self_attn.kv_a_proj_with_mqa.weight", ("self_attn", "kv_a_proj_with_mqa", "kernel"), "transpose"),
    ("self_attn.kv_a_layernorm.weight", ("self_attn", "kv_a_layernorm", "weight"), "copy"),
    ("self_attn.kv_b_proj.weight", ("self_attn", "kv_b_proj", "kernel"), "transpose"),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), "transpose"),
]
_MLA_Q_FULL = [("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), "transpose")]
_MLA_Q_LORA = [
    ("self_attn.q_a_proj.weight", ("self_attn", "q_a_proj", "kernel"), "transpose"),
    ("self_attn.q_a_layernorm.weight", ("self_attn", "q_a_layernorm", "weight"), "copy"),
    ("self_attn.q_b_proj.weight", ("self_attn", "q_b_proj", "kernel"), "transpose"),
]
_MLA_GATE = [("self_attn.g_proj.weight", ("self_attn", "g_proj", "kernel"), "transpose")]
_DENSE_MLP = [
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), "transpose"),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), "transpose"),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), "transpose"),
]
# transformers' save_pretrained writes a dense layer's MLP under block_sparse_moe.* (arch §8.3).
_DENSE_MLP_ALIAS = ("mlp.", "block_sparse_moe.")
_MOE = [
    ("block_sparse_moe.gate.weight", ("block_sparse_moe", "gate", "kernel"), "transpose"),
    ("block_sparse_moe.gate.e_score_correction_bias", ("block_sparse_moe", "gate", "e_score_correction_bias"), "copy"),
]
_MOE_SHARED = [
    ("block_sparse_moe.shared_experts.gate_proj.weight", ("block_sparse_moe", "shared_experts", "gate_proj", "kernel"), "transpose"),
    ("block_sparse_moe.shared_experts.up_proj.weight", ("block_sparse_moe", "shared_experts", "up_proj", "kernel"), "transpose"),
    ("block_sparse_moe.shared_experts.down_proj.weight", ("block_sparse_moe", "shared_experts", "down_proj", "kernel"), "transpose"),
]
_MOE_LATENT = [
    ("block_sparse_moe.routed_expert_down_proj.weight", ("block_sparse_moe", "routed_expert_down_proj", "kernel"), "transpose"),
    ("block_sparse_moe.routed_expert_up_proj.weight", ("block_sparse_moe", "routed_expert_up_proj", "kernel"), "transpose"),
]
_MOE_LATENT_NORM = [
    ("block_sparse_moe.routed_expert_norm.weight", ("block_sparse_moe", "routed_expert_norm", "weight"), "copy"),
]
_EXPERT_WEIGHTS = [("w1", "w1"), ("w3", "w3"), ("w2", "w2")]  # gate, up, down -> stacked [E, in, out]
_MTP = [
    ("enorm.weight", ("enorm", "weight"), "copy"),
    ("hnorm.weight", ("hnorm", "weight"), "copy"),
    ("eh_proj.weight", ("eh_proj", "kernel"), "transpose"),
    ("shared_head.norm.weight", ("shared_head", "norm", "weight"), "copy"),
    ("shared_head.head.weight", ("shared_head", "head", "kernel"), "transpose"),
]
_K3_SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")


def checkpoint_prefixes(cfg: ModelConfig) -> tuple[str, str]:
    """(model prefix, LM-head prefix): K3 nests the text model under `language_model.`."""
    if cfg.model_type == "kimi_k3":
        return "language_model.model.", "language_model.lm_head."
    return "model.", "lm_head."


def _block_table(cfg: ModelConfig, mixer: str, ffn: str) -> list[tuple]:
    table = list(_NORMS)
    if mixer == "kda":
        a_log = "a_log_per_head" if cfg.kda.a_log_policy == "per_head" else "a_log_per_channel"
        table += _KDA + [("self_attn.A_log", ("self_attn", "A_log"), a_log)]
        table += _KDA_FULL_RANK_GATE if cfg.kda.use_full_rank_gate else _KDA_LOW_RANK_GATE
    else:
        table += _MLA + (_MLA_Q_FULL if cfg.mla.q_lora_rank is None else _MLA_Q_LORA)
        table += _MLA_GATE if cfg.mla.use_output_gate else []
    if ffn == "dense":
        table += _DENSE_MLP
    else:
        table += _MOE + (_MOE_SHARED if cfg.moe.num_shared_experts else [])
        if cfg.moe.latent_size is not None:
            table += _MOE_LATENT + (_MOE_LATENT_NORM if cfg.moe.latent_use_norm else [])
    return table


def _add_block(rules: dict, cfg: ModelConfig, prefix: str, root: tuple, mixer: str, ffn: str) -> None:
    for suffix, sub, hook in _block_table(cfg, mixer, ffn):
        rules[prefix + suffix] = TensorRule(root + sub, hook)
    if ffn != "moe":
        return
    for e in range(cfg.moe.num_experts):
        for stored, param in _EXPERT_WEIGHTS:
            name = f"{prefix}block_sparse_moe.experts.{e}.{stored}."
            path = root + ("block_sparse_moe", "experts", param)
            if cfg.quantization == "mxfp4" and cfg.moe.packed_experts:     # kept packed: two parameters
                layout = cfg.moe.packed_layout
                codes = "copy_uint8" if layout in COLUMN_LAYOUTS else "transpose_uint8"
                scales = "transpose_uint8"
                if layout == "handoff" and param in ("w1", "w3"):         # gate and up: columns in hand-off order
                    codes, scales = "copy_uint8_hand_off", "transpose_uint8_hand_off"
                rules[name + "weight_packed"] = TensorRule(path[:-1] + (param + "_packed",), codes, e)
                rules[name + "weight_scale"] = TensorRule(path[:-1] + (param + "_scale",), scales, e)
            elif cfg.quantization == "mxfp4":
                rules[name + "weight_packed"] = TensorRule(path, "mxfp4_packed", e, partner=name + "weight_scale")
                rules[name + "weight_scale"] = TensorRule(path, "mxfp4_scale", e)
            else:
                rules[name + "weight"] = TensorRule(path, "transpose", e)


def tensor_rules(cfg: ModelConfig) -> dict[str, TensorRule]:
    """Every tensor the checkpoint must hold for `cfg`, by canonical name."""
    model_prefix, head_prefix = checkpoint_prefixes(cfg)
    rules = {
        f"{model_prefix}embed_tokens.weight": TensorRule(("model", "embed_tokens", "embedding"), "copy"),
        f"{model_prefix}norm.weight": TensorRule(("model", "norm", "weight"), "copy"),
        f"{head_prefix}weight": TensorRule(("lm_head", "kernel"), "transpose"),
    }
    if cfg.attn_res is not None:
        rules[f"{model_prefix}output_attn_res_norm.weight"] = TensorRule(("model", "output_attn_res", "norm", "weight"), "copy")
        rules[f"{model_prefix}output_attn_res_proj.weight"] = TensorRule(("model", "output_attn_res", "proj", "kernel"), "transpose")
    for i in range(cfg.num_layers):
        prefix, root = f"{model_prefix}layers.{i}.", ("model", "layers", i)
        _add_block(rules, cfg, prefix, root, cfg.mixers[i], cfg.ffns[i])
        if cfg.attn_res is not None:
            for suffix, sub, hook in _ATTN_RES:
                rules[prefix + suffix] = TensorRule(root + sub, hook)
    for j in range(cfg.num_mtp_layers):
        prefix, root = f"{model_prefix}layers.{cfg.num_layers + j}.", ("mtp", j)
        _add_block(rules, cfg, prefix, root, cfg.mtp_mixers[j], cfg.mtp_ffns[j])
        for suffix, sub, hook in _MTP:
            rules[prefix + suffix] = TensorRule(root + sub, hook)
        if j == 0 and cfg.mtp_own_embedding:
            rules[prefix + "embed_tokens.weight"] = TensorRule(root + ("embed_tokens", "embedding"), "copy")
    return rules


def tensor_aliases(cfg: ModelConfig) -> dict[str, str]:
    """Alternative stored name -> canonical name (the same tensor written by another tool)."""
    model_prefix, _ = checkpoint_prefixes(cfg)
    aliases = {}
    old, new = _DENSE_MLP_ALIAS
    for i, ffn in enumerate(cfg.ffns):
        if ffn == "dense":
            for suffix, _, _ in _DENSE_MLP:
                aliases[f"{model_prefix}layers.{i}.{suffix.replace(old, new, 1)}"] = f"{model_prefix}layers.{i}.{suffix}"
    return aliases


def is_skipped(cfg: ModelConfig, name: str) -> bool:
    """Tensors a text-model load deliberately ignores: K3's vision tower and projector, and AttnRes
    weights stored with an MTP layer (the MTP block has no AttnRes, arch §7)."""
    if cfg.model_type == "kimi_k3" and name.startswith(_K3_SKIPPED_PREFIXES):
        return True
    model_prefix, _ = checkpoint_prefixes(cfg)
    m = re.match(re.escape(model_prefix) + r"layers\.(\d+)\.(self_attention_res|mlp_res)_(norm|proj)\.weight$", name)
    return bool(m) and int(m.group(1)) >= cfg.num_layers


def mtp_embedding_name(cfg: ModelConfig, num_mtp_layers: int) -> str:
    """Where a checkpoint stores the MTP layers' own embedding table, if it has one."""
    return f"{checkpoint_prefixes(cfg)[0]}layers.{cfg.num_layers}.embed_tokens.weight" if num_mtp_layers else ""
