"""Checkpoints are checked when read: crc32c on every chunk of a converted checkpoint, a checksum of
its manifest, non-finite weights refused on both load paths, and `verify` re-reads a whole
converted checkpoint against its recorded SHA-256 checksums. Every error is one line naming the
parameter, tensor or key."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tensorstore as ts
from checkpoints import chunk_files, flip_byte, rewrite_tensors

import k3jax
from k3jax.checkpoint.convert import convert
from k3jax.checkpoint.orbax_format import MANIFEST
from k3jax.checkpoint.safetensors_io import CheckpointError
from k3jax.checkpoint.verify import verify_main

EXPERT_W1 = "model.layers.1.block_sparse_moe.experts.w1"


@pytest.fixture(scope="module")
def converted(oracle_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("converted") / "out"
    convert(oracle_dir / "hf" / "kl_alt", dst, dtype="float32")
    return dst


@pytest.fixture
def ckpt(converted, tmp_path):
    """A private copy of the converted checkpoint, free to damage."""
    return shutil.copytree(converted, tmp_path / "ckpt")


def _one_line_error(fn) -> str:
    with pytest.raises(CheckpointError) as err:
        fn()
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def _edit_manifest(ckpt, change) -> None:
    manifest = json.loads((ckpt / MANIFEST).read_text())
    change(manifest)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _write_array(ckpt, param: str, value) -> None:
    """Overwrites a parameter's data through tensorstore (so its chunk checksums stay valid)."""
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(ckpt / "params" / param)}}).result()
    arr.write(np.asarray(value, arr.dtype.numpy_dtype)).result()


def _read_array(ckpt, param: str) -> np.ndarray:
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(ckpt / "params" / param)}}).result()
    return arr.read().result()


def _inner_chunk(ckpt, param: str, file, k: int) -> tuple[int, int]:
    """(offset, length) of inner chunk k in a shard file, from the index at its end (an offset and a
    length per inner chunk, little-endian u64, then a crc32c)."""
    meta = json.loads((ckpt / "params" / param / "zarr.json").read_text())
    outer = meta["chunk_grid"]["configuration"]["chunk_shape"]
    inner = meta["codecs"][0]["configuration"]["chunk_shape"]
    n = int(np.prod([o // i for o, i in zip(outer, inner)]))
    data = file.read_bytes()
    index = np.frombuffer(data[-(16 * n + 4):-4], "<u8").reshape(n, 2)
    return int(index[k][0]), int(index[k][1])


@pytest.mark.parametrize("param", ["model.norm.weight", EXPERT_W1])
def test_flipped_byte_is_refused_naming_the_parameter(ckpt, param):
    """A flip inside an inner chunk's compressed bytes fails its crc32c; one in a zstd frame's header
    (the first bytes of an expert's chunk in a file of several) fails the decompression first: both are
    one line naming the parameter and calling it damaged."""
    file = chunk_files(ckpt, param)[0]
    offset, length = _inner_chunk(ckpt, param, file, 0)
    flip_byte(file, offset + length // 2)
    msg = _one_line_error(lambda: k3jax.load(ckpt))
    assert f"parameter {param}" in msg and "damaged" in msg and "crc32c" in msg
    flip_byte(file, offset + length // 2)                   # undone
    flip_byte(file, offset + 1)                             # the frame's magic number
    msg = _one_line_error(lambda: k3jax.load(ckpt))
    assert f"parameter {param}" in msg and "damaged" in msg


def test_missing_chunk_file_is_one_line_naming_the_parameter(ckpt):
    chunk_files(ckpt, "lm_head.kernel")[0].unlink()
    assert "parameter lm_head.kernel" in _one_line_error(lambda: k3jax.load(ckpt))


def test_edited_config_does_not_match_the_manifest_checksum(ckpt):
    _edit_manifest(ckpt, lambda m: m["hf_config"].update(rms_norm_eps=1e-3))
    assert "checksum" in _one_line_error(lambda: k3jax.load(ckpt))


def test_older_format_asks_for_a_new_conversion(ckpt):
    _edit_manifest(ckpt, lambda m: m.update(format="k3jax-orbax/1"))
    msg = _one_line_error(lambda: k3jax.load(ckpt))
    assert "k3jax-orbax/1" in msg and "convert the source again" in msg


@pytest.mark.parametrize("key", ["params", "hf_config", "dtype", "format"])
def test_missing_manifest_key_is_one_line(ckpt, key):
    _edit_manifest(ckpt, lambda m: m.pop(key))
    assert repr(key) in _one_line_error(lambda: k3jax.load(ckpt))


@pytest.mark.parametrize("change,key", [
    (lambda m: m.update(params=[]), "params"),
    (lambda m: m.update(hf_config=None), "hf_config"),
    (lambda m: m["params"]["model.norm.weight"].update(shape="64"), "model.norm.weight"),
])
def test_mistyped_manifest_entry_is_one_line(ckpt, change, key):
    _edit_manifest(ckpt, change)
    assert key in _one_line_error(lambda: k3jax.load(ckpt))


def test_non_finite_converted_weight_is_named(ckpt):
    value = _read_array(ckpt, EXPERT_W1)
    value[5, 0, 0] = np.inf
    _write_array(ckpt, EXPERT_W1, value)
    msg = _one_line_error(lambda: k3jax.load(ckpt))
    assert f"{EXPERT_W1} (expert 5)" in msg and "non-finite" in msg


def test_non_finite_hugging_face_tensors_are_named(oracle_dir, tmp_path):
    src = shutil.copytree(oracle_dir / "hf" / "kl_alt", tmp_path / "src")

    def change(t):
        t["model.norm.weight"][3] = np.nan
        t["model.layers.2.block_sparse_moe.experts.6.w2.weight"][0, 1] = -np.inf
    rewrite_tensors(src, change)
    for dtype in ("float32", "bfloat16"):
        msg = _one_line_error(lambda: k3jax.load(src, dtype=dtype))
        assert "model.norm.weight" in msg and "model.layers.2.block_sparse_moe.experts.6.w2.weight" in msg
        assert "non-finite" in msg


def test_verify_main_accepts_a_good_checkpoint(converted, capsys):
    assert verify_main([str(converted)], prog="k3jax verify") == 0
    out = capsys.readouterr().out
    assert "OK" in out and str(converted) in out


def test_verify_main_names_damaged_and_changed_parameters(ckpt, capsys):
    flip_byte(chunk_files(ckpt, "model.norm.weight")[0])
    value = _read_array(ckpt, "lm_head.kernel")
    _write_array(ckpt, "lm_head.kernel", value + 1)  # valid chunks, wrong content
    assert verify_main([str(ckpt)], prog="k3jax verify") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3jax verify: error:") and "\n" not in err
    assert "model.norm.weight" in err and "lm_head.kernel" in err and "sha256" in err


def test_verify_main_on_a_directory_that_is_not_a_converted_checkpoint(oracle_dir, capsys):
    assert verify_main([str(oracle_dir / "hf" / "kl_alt")], prog="k3jax verify") == 1
    err = capsys.readouterr().err.strip()
    assert "k3jax.json" in err and "\n" not in err
