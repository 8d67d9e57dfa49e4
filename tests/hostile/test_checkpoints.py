"""Hostile checkpoint inputs (a module meant to keep growing): whatever a config.json, a safetensors
index or a safetensors header holds, the parsers return a valid result or raise their one error
type (ConfigError for configs, CheckpointError for checkpoints) with a one-line message; never
another exception, a hang, or a file read from outside the checkpoint directory.

Hypothesis runs are kept small (the suite runs them on every CI run); raise max_examples locally
to hunt for more.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3jax.checkpoint.safetensors_io import INDEX_NAME, CheckpointError, SafetensorsCheckpoint, write_safetensors
from k3jax.config import ConfigError, kimi_linear_48b_a3b, tiny_k3
from k3jax.hf_config import from_hf_config, to_hf_config

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any JSON value, small.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)

# What transformers' save_pretrained writes for a tiny Kimi-Linear (aliases, layer_types, nulls).
SAVED_PRETRAINED = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128, "kv_lora_rank": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4, "linear_head_dim": 16, "linear_num_heads": 4,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "model_max_length": 1048576,
    "moe_intermediate_size": 32, "moe_renormalize": True, "num_attention_heads": 4, "num_expert_group": 1,
    "num_experts": 8, "num_experts_per_token": 2, "num_hidden_layers": 4, "num_key_value_heads": 4,
    "num_shared_experts": 1, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "v_head_dim": 16, "vocab_size": 512,
}
REAL_CONFIGS = [to_hf_config(kimi_linear_48b_a3b()), to_hf_config(tiny_k3()),
                to_hf_config(dataclasses.replace(tiny_k3(), quantization="mxfp4")), SAVED_PRETRAINED]


def _places(node, prefix=()):
    """Every key path (dict keys and list indices) inside a JSON value."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield prefix + (key,)
        yield from _places(child, prefix + (key,))


@st.composite
def mutated_configs(draw):
    """A real config with one to three fields replaced, deleted, nulled, stringified or wrapped."""
    cfg = copy.deepcopy(draw(st.sampled_from(REAL_CONFIGS)))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_places(cfg))))
        parent = cfg
        for key in path[:-1]:
            parent = parent[key]
        key, old = path[-1], parent[path[-1]]
        action = draw(st.sampled_from(["replace", "delete", "null", "string", "list", "number"]))
        if action == "delete":
            del parent[key]
        elif action == "number":
            parent[key] = draw(st.sampled_from([0, -1, 1, 2 ** 63, 10 ** 9, 0.5, float("nan"), float("inf"), True]))
        else:
            parent[key] = {"replace": lambda: draw(JSON), "null": lambda: None, "string": lambda: str(old),
                           "list": lambda: [old]}[action]()
        if not list(_places(cfg)):
            break
    return cfg


@FUZZ
@given(mutated_configs())
def test_config_parser_raises_only_config_errors(raw):
    try:
        from_hf_config(raw)
    except ConfigError as e:
        assert "\n" not in str(e)


@FUZZ
@given(JSON)
def test_config_parser_on_any_json(raw):
    try:
        from_hf_config(raw)
    except ConfigError:
        pass


TENSORS = {"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "b.bias": np.ones(4, np.float32)}
SHARD_NAMES = st.sampled_from(["model.safetensors", "./model.safetensors", "sub/../model.safetensors",
                               "../model.safetensors", "../../etc/passwd", "/etc/passwd", "/dev/zero", "", ".", "..",
                               "sub", "fifo.safetensors", "missing.safetensors", "model.safetensors/", "a\x00b",
                               "\ud800.safetensors"]) | st.text(max_size=10)
INDEXES = st.one_of(
    JSON,
    st.fixed_dictionaries({"weight_map": JSON}),
    st.fixed_dictionaries({"metadata": JSON, "weight_map": st.dictionaries(
        st.sampled_from(sorted(TENSORS)) | st.text(max_size=6), SHARD_NAMES | JSON, max_size=4)}),
    st.just({"weight_map": {n: "model.safetensors" for n in TENSORS}}),
)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A directory with one valid shard, a subdirectory and a FIFO named like a shard."""
    path = tmp_path_factory.mktemp("hostile")
    write_safetensors(path / "model.safetensors", TENSORS)
    (path / "sub").mkdir()
    os.mkfifo(path / "fifo.safetensors")
    return path


def _open_or_checkpoint_error(path) -> None:
    """A checkpoint opens and reads back completely from inside `path`, or raises one CheckpointError line."""
    try:
        ckpt = SafetensorsCheckpoint(path)
        root = os.path.realpath(path)
        for name in ckpt.names():
            info = ckpt.info(name)
            assert os.path.commonpath([root, os.path.realpath(info.file)]) == root
            assert ckpt.read(name).shape == info.shape
    except CheckpointError as e:
        assert "\n" not in str(e)


@pytest.mark.timeout(300)
@FUZZ
@given(index=INDEXES | st.binary(max_size=40))
def test_index_parser_raises_only_checkpoint_errors(checkpoint_dir, index):
    raw = index if isinstance(index, bytes) else json.dumps(index).encode("utf-8", "surrogatepass")
    (checkpoint_dir / INDEX_NAME).write_bytes(raw)
    _open_or_checkpoint_error(checkpoint_dir)


DTYPE_NAMES = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "F4", "f32", ""]) | JSON
SIZES = st.integers(-3, 12) | st.sampled_from([2 ** 31, 2 ** 63, 2 ** 64 + 1, 10 ** 30])
ENTRIES = st.fixed_dictionaries({"dtype": DTYPE_NAMES, "shape": st.lists(SIZES, max_size=3) | JSON,
                                 "data_offsets": st.lists(SIZES, max_size=3) | JSON}) | JSON


@st.composite
def safetensors_files(draw):
    """A header length, a header of tensor entries (some valid) and a few data bytes."""
    header = draw(st.dictionaries(st.text(max_size=6), ENTRIES, max_size=4))
    if draw(st.booleans()):
        header["__metadata__"] = draw(JSON)
    raw = json.dumps(header).encode("utf-8", "surrogatepass")
    length = len(raw) + draw(st.sampled_from([0, 0, 0, -1, 1, 2 ** 40, 2 ** 64 - 1 - len(raw)]))
    return struct.pack("<Q", max(length, 0)) + raw + draw(st.binary(max_size=64))


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile_header")


@FUZZ
@given(data=safetensors_files() | st.binary(max_size=80))
def test_header_parser_raises_only_checkpoint_errors(shard_dir, data):
    (shard_dir / "model.safetensors").write_bytes(data)
    _open_or_checkpoint_error(shard_dir)
