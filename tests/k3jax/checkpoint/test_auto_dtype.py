"""dtype="auto" (the default of k3jax.load / load_model and the CLI): a checkpoint loads in its own
dtype: the declared one in config.json, else the floating dtype holding most stored bytes; bf16 and
fp32 are kept, anything else loads as fp32. Built-in tiny models load in fp32."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.checkpoint.loader import checkpoint_dtype
from k3jax.checkpoint.writer import save_checkpoint
from k3jax.config import tiny_kimi_linear


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A tiny Kimi-Linear checkpoint written in bf16 and one in fp32 (no dtype in config.json)."""
    paths = {}
    for dtype in ("bfloat16", "float32"):
        path = tmp_path_factory.mktemp(dtype)
        save_checkpoint(k3jax.CausalLM.random(tiny_kimi_linear(), seed=2, dtype=dtype), str(path))
        paths[dtype] = path
    return paths


def _declare(path, key, value, nested=False):
    with open(path / "config.json") as f:
        cfg = json.load(f)
    (cfg.setdefault("text_config", {}) if nested else cfg)[key] = value
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f)


def test_stored_dtype_decides_without_a_declaration(written):
    assert checkpoint_dtype(written["bfloat16"]) == "bfloat16"   # A_log and dt_bias stay fp32: fewer bytes
    assert checkpoint_dtype(written["float32"]) == "float32"
    model = k3jax.load(written["bfloat16"])
    assert model.dtype == jnp.bfloat16
    assert k3jax.load(written["bfloat16"], dtype="float32").dtype == jnp.float32


@pytest.mark.parametrize("key,value,nested,expected", [
    ("torch_dtype", "bfloat16", False, "bfloat16"),
    ("dtype", "float32", False, "float32"),
    ("torch_dtype", "bfloat16", True, "bfloat16"),
    ("torch_dtype", "float16", False, "float32"),     # neither bf16 nor fp32: exact in fp32
])
def test_declared_dtype_decides(written, tmp_path, key, value, nested, expected):
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(written["float32"], path)
    _declare(path, key, value, nested)
    assert checkpoint_dtype(path) == expected


def test_converted_checkpoint_keeps_its_dtype(written, tmp_path):
    from k3jax.checkpoint.convert import convert
    dst = tmp_path / "converted"
    convert(str(written["bfloat16"]), str(dst), dtype="bfloat16")
    assert checkpoint_dtype(dst) == "bfloat16"
    model = k3jax.load(dst)
    assert model.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(model.logits(np.array([[1, 2, 3]])), np.float32)).all()


def test_builtin_models_load_in_float32():
    assert k3jax.load_model("tiny-k3-random").dtype == jnp.float32
    assert k3jax.load_model("tiny-k3").dtype == jnp.float32
