"""The shipped trained model `tiny-k3` (k3jax/models/tiny_k3, trained by scripts/train_tiny_k3.py):
its files match their checksums, it loads by name through the checkpoint loader with every K3 feature on, and its held-out loss (fp32, CPU) stays within 1% of the
value recorded when it was trained, so a numerical regression of the forward pass shows up here."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import k3jax
from k3jax.tiny import CHECKSUMS, eval_slice_loss, trained_path, verify_checksums

NAME = "tiny-k3"


@pytest.fixture(scope="module")
def path():
    return trained_path(NAME)


@pytest.fixture(scope="module")
def record(path):
    with open(os.path.join(path, "training.json")) as f:
        return json.load(f)


def test_every_shipped_file_is_checksummed_and_within_size(path):
    verify_checksums(path)
    with open(os.path.join(path, CHECKSUMS)) as f:
        listed = sorted(line.split()[1] for line in f)
    assert listed == sorted(n for n in os.listdir(path) if n != CHECKSUMS and not n.startswith("__"))
    assert {"config.json", "model.safetensors", "tiktoken.model", "tokenizer_config.json"} <= set(listed)
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 8 * 2**20


def test_a_changed_file_is_refused(path, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(path, copy)
    with open(copy / "tiktoken.model", "ab") as f:
        f.write(b"\n")
    with pytest.raises(ValueError, match="tiktoken.model"):
        verify_checksums(str(copy))


def test_heldout_loss_within_one_percent_of_the_record(path, record):
    model = k3jax.load_model(NAME, dtype="float32")
    cfg = model.config
    # every K3 feature on: bounded KDA gate, MLA, AttnRes blocks, latent MoE with SiTU, one MTP layer
    assert cfg.model_type == "kimi_k3" and cfg.kda.gate_lower_bound is not None and "mla" in cfg.mixers
    assert cfg.attn_res is not None and cfg.moe.latent_size is not None and cfg.moe.activation.kind == "situ"
    assert cfg.num_mtp_layers == 1 and model.tokenizer is not None
    loss, n = eval_slice_loss(model, path)
    expected = record["eval_slice"]["loss"]
    assert n == record["eval_slice"]["predicted_tokens"]
    assert abs(loss - expected) <= 0.01 * expected, f"held-out loss {loss:.5f}, recorded {expected:.5f}"
