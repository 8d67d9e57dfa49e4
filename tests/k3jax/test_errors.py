"""Bad input gets one clear error naming the problem."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import k3jax
from k3jax.checkpoint.safetensors_io import CheckpointError


@pytest.fixture(scope="module")
def model(tiny_config):
    return k3jax.CausalLM.random(tiny_config, seed=1)


def test_bad_token_ids(model):
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=f"id {vocab} outside the vocabulary"):
        model.logits([[1, 2, vocab]])
    with pytest.raises(ValueError, match="id -1 outside the vocabulary"):
        model.prefill([[1, -1]])
    with pytest.raises(ValueError, match="token_ids is empty"):
        model.prefill(np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="integer token ids"):
        model.logits([[0.5, 1.0]])
    with pytest.raises(ValueError, match=r"must be \[B, T\]"):
        model.logits(np.zeros((1, 2, 3), np.int32))
    _, state = model.prefill([[1, 2, 3]], max_len=8)
    with pytest.raises(ValueError, match="next_tokens holds id"):
        model.decode_step(state, [vocab + 5])
    with pytest.raises(ValueError, match="state holds 1 rows but 2 were given"):
        model.decode_step(state, [1, 2])


def test_bad_attention_mask_and_lengths(model):
    with pytest.raises(ValueError, match="left-padded"):
        model.prefill([[1, 2, 3]], [[1, 1, 0]])
    with pytest.raises(ValueError, match="row 1 has no real token"):
        model.prefill([[1, 2], [3, 4]], [[1, 1], [0, 0]])
    with pytest.raises(ValueError, match="does not match"):
        model.prefill([[1, 2]], [[1, 1, 1]])
    with pytest.raises(ValueError, match="exceeds max_len 4"):
        model.prefill([[1, 2, 3, 4, 5]], max_len=4)
    _, state = model.prefill([list(range(3, 66))], max_len=64)   # capacity is allocated in 64-slot steps
    assert state.capacity == 64
    _, state = model.decode_step(state, [4])
    with pytest.raises(ValueError, match=r"cache is full \(64 tokens per row\)"):
        model.decode_step(state, [5])
    with pytest.raises(ValueError, match="unsupported dtype"):
        k3jax.CausalLM.random(model.config, dtype="float16")


@pytest.fixture
def hf_copy(oracle_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(oracle_dir / "hf" / "kl_alt", dst)
    return dst


def _rewrite(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_unexpected_and_misshaped_tensors_in_one_error(hf_copy):
    def change(t):
        del t["model.layers.0.self_attn.dt_bias"]
        t["model.layers.1.self_attn.extra.weight"] = np.zeros(3, np.float32)
        t["model.layers.2.self_attn.q_proj.weight"] = t["model.layers.2.self_attn.q_proj.weight"][:, :10]
    _rewrite(hf_copy, change)
    with pytest.raises(CheckpointError) as err:
        k3jax.load(hf_copy)
    msg = str(err.value)
    assert "1 missing: model.layers.0.self_attn.dt_bias" in msg
    assert "1 unexpected: model.layers.1.self_attn.extra.weight" in msg
    assert "1 wrong shape: model.layers.2.self_attn.q_proj.weight [64, 10] (expected [64, 64])" in msg


def test_wrong_dtype(hf_copy):
    _rewrite(hf_copy, lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(CheckpointError, match="wrong dtype: model.norm.weight int32"):
        k3jax.load(hf_copy)


def test_corrupt_and_truncated_files(hf_copy):
    data = (hf_copy / "model.safetensors").read_bytes()
    (hf_copy / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated file"):
        k3jax.load(hf_copy)
    (hf_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!!" + data[24:])
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        k3jax.load(hf_copy)


def test_index_naming_a_missing_shard(hf_copy):
    names = list(load_file(str(hf_copy / "model.safetensors")))
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing: \\['model-00002-of-00002.safetensors'\\]"):
        k3jax.load(hf_copy)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        k3jax.load(tmp_path)
