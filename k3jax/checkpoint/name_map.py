"""The one place that knows checkpoint tensor names: Hugging Face / Moonshot name -> parameter
path (+ expert index) + transform hook, generated from the model config (arch §8).

Layer suffix tables below are declarative; `tensor_rules` expands them per layer kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3jax.config import ModelConfig


@dataclass(frozen=True)
class TensorRule:
    """Where one checkpoint tensor goes: `path` in the parameter tree (stacked experts: `expert`
    indexes the leading axis) after the transform `hook`."""

    path: tuple
    hook: str
    expert: int | None = None


# (checkpoint suffix, parameter sub-path, hook). Linear weights are stored [out, in] and kept [in, out].
_NORMS = [
    ("input_layernorm.weight", ("input_layernorm", "weight"), "copy"),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), "copy"),
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
    ("self_attn.A_log", ("self_attn", "A_log"), "a_log"),
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
_DENSE_MLP = [
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), "transpose"),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), "transpose"),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), "transpose"),
]
# transformers' save_pretrained writes a dense layer's MLP under block_sparse_moe.* (arch §8.3).
_DENSE_MLP_ALIAS = {"mlp.": "block_sparse_moe."}
_MOE = [
    ("block_sparse_moe.gate.weight", ("block_sparse_moe", "gate", "kernel"), "transpose"),
    ("block_sparse_moe.gate.e_score_correction_bias", ("block_sparse_moe", "gate", "e_score_correction_bias"), "copy"),
]
_MOE_SHARED = [
    ("block_sparse_moe.shared_experts.gate_proj.weight", ("block_sparse_moe", "shared_experts", "gate_proj", "kernel"), "transpose"),
    ("block_sparse_moe.shared_experts.up_proj.weight", ("block_sparse_moe", "shared_experts", "up_proj", "kernel"), "transpose"),
    ("block_sparse_moe.shared_experts.down_proj.weight", ("block_sparse_moe", "shared_experts", "down_proj", "kernel"), "transpose"),
]
_EXPERT = [  # per expert e: block_sparse_moe.experts.{e}.<w>.weight -> stacked [E, ...]
    ("w1.weight", ("block_sparse_moe", "experts", "w1"), "transpose"),
    ("w3.weight", ("block_sparse_moe", "experts", "w3"), "transpose"),
    ("w2.weight", ("block_sparse_moe", "experts", "w2"), "transpose"),
]


def _layer_table(cfg: ModelConfig, i: int) -> list[tuple]:
    table = list(_NORMS)
    if cfg.mixers[i] == "kda":
        table += _KDA + (_KDA_FULL_RANK_GATE if cfg.kda.use_full_rank_gate else _KDA_LOW_RANK_GATE)
    else:
        table += _MLA + (_MLA_Q_FULL if cfg.mla.q_lora_rank is None else _MLA_Q_LORA)
    if cfg.ffns[i] == "dense":
        table += _DENSE_MLP
    else:
        table += _MOE + (_MOE_SHARED if cfg.moe.num_shared_experts else [])
    return table


def tensor_rules(cfg: ModelConfig, *, model_prefix: str = "model.", head_prefix: str = "lm_head.") -> dict[str, TensorRule]:
    """Every tensor the checkpoint must hold for `cfg`, by canonical name."""
    rules = {
        f"{model_prefix}embed_tokens.weight": TensorRule(("model", "embed_tokens", "embedding"), "copy"),
        f"{model_prefix}norm.weight": TensorRule(("model", "norm", "weight"), "copy"),
        f"{head_prefix}weight": TensorRule(("lm_head", "kernel"), "transpose"),
    }
    for i in range(cfg.num_layers):
        layer = f"{model_prefix}layers.{i}."
        root = ("model", "layers", i)
        for suffix, sub, hook in _layer_table(cfg, i):
            rules[layer + suffix] = TensorRule(root + sub, hook)
        if cfg.ffns[i] == "moe":
            for e in range(cfg.moe.num_experts):
                for suffix, sub, hook in _EXPERT:
                    rules[f"{layer}block_sparse_moe.experts.{e}.{suffix}"] = TensorRule(root + sub, hook, e)
    return rules


def tensor_aliases(cfg: ModelConfig, *, model_prefix: str = "model.") -> dict[str, str]:
    """Alternative stored name -> canonical name (the same tensor written by another tool)."""
    aliases = {}
    for i in range(cfg.num_layers):
        if cfg.ffns[i] == "dense":
            layer = f"{model_prefix}layers.{i}."
            for suffix, _, _ in _DENSE_MLP:
                for old, new in _DENSE_MLP_ALIAS.items():
                    aliases[layer + suffix.replace(old, new, 1)] = layer + suffix
    return aliases
