"""Only regular files inside the checkpoint directory are read: shard names from
`model.safetensors.index.json` that leave the directory, FIFOs named like shards and a malformed
`weight_map` give one CheckpointError line, for loading and for conversion alike."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import k3jax
from k3jax.checkpoint.convert import main as convert_main
from k3jax.checkpoint.safetensors_io import INDEX_NAME, CheckpointError, SafetensorsCheckpoint


@pytest.fixture
def src(oracle_dir, tmp_path):
    return shutil.copytree(oracle_dir / "hf" / "kl_alt", tmp_path / "src")


def _index(src, file_of) -> None:
    """Writes an index for the tensors of `src/model.safetensors` (read before any file is moved)."""
    names = SafetensorsCheckpoint(src).names()
    (src / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {n: file_of(n) for n in names}}))


def _load_and_convert_refuse(src, tmp_path, capsys, expected: str) -> None:
    with pytest.raises(CheckpointError) as err:
        k3jax.load(src)
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert convert_main([str(src), str(tmp_path / "dst"), "--quiet"]) == 1
    out = capsys.readouterr().err.strip()
    assert expected in out and "\n" not in out
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.partial").exists()


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_index_pointing_outside_the_directory_is_refused(src, tmp_path, capsys, where):
    outside = tmp_path / "elsewhere.safetensors"   # a valid shard, but not inside the checkpoint
    name = "../elsewhere.safetensors" if where == "parent" else str(outside)
    _index(src, lambda n: name)
    shutil.move(src / "model.safetensors", outside)
    _load_and_convert_refuse(src, tmp_path, capsys, f"shard {name!r} is outside the checkpoint directory")


@pytest.mark.timeout(120)  # opening a FIFO for reading blocks until a writer appears
def test_fifo_named_in_the_index_is_refused(src, tmp_path, capsys):
    _index(src, lambda n: "model-00002-of-00002.safetensors" if n == "model.norm.weight" else "model.safetensors")
    os.mkfifo(src / "model-00002-of-00002.safetensors")
    _load_and_convert_refuse(src, tmp_path, capsys, "model-00002-of-00002.safetensors: not a regular file")


@pytest.mark.timeout(120)
def test_fifo_found_by_listing_is_refused(src, tmp_path, capsys):
    os.mkfifo(src / "extra.safetensors")
    _load_and_convert_refuse(src, tmp_path, capsys, "extra.safetensors: not a regular file")


@pytest.mark.parametrize("index", [
    [1, 2],
    {"weight_map": None},
    {"weight_map": ["model.safetensors"]},
    {"weight_map": {"model.norm.weight": 1}},
    {"weight_map": {"model.norm.weight": ["model.safetensors"]}},
    {"weight_map": {"model.norm.weight": {"file": "model.safetensors"}}},
    {"weight_map": {"model.norm.weight": "bad\u0000name.safetensors"}},
])
def test_malformed_weight_map_is_one_line(src, tmp_path, capsys, index):
    (src / INDEX_NAME).write_text(json.dumps(index))
    _load_and_convert_refuse(src, tmp_path, capsys, INDEX_NAME)


def test_shard_in_a_subdirectory_and_a_symlinked_shard_still_load(src, tmp_path):
    """Relative names inside the directory stay valid, and so do symlinks placed in the directory (the
    Hugging Face cache links its snapshot files to blobs)."""
    _index(src, lambda n: "shards/./model.safetensors")
    (src / "shards").mkdir()
    shutil.move(src / "model.safetensors", src / "shards" / "model.safetensors")
    reference = k3jax.load(src)
    blob = tmp_path / "blob"
    shutil.move(src / "shards" / "model.safetensors", blob)
    os.symlink(blob, src / "shards" / "model.safetensors")
    assert k3jax.load(src).load_report.tensors == reference.load_report.tensors
