"""The converter never loses or mixes data: it deletes only a DST.partial it created, runs one
conversion per destination at a time, refuses to resume from a changed source or with other
options (--restart starts over), and leaves nothing behind for a source with non-finite weights or
a failed --verify."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoints import big_kimi_linear_checkpoint, chunk_files, flip_byte, rewrite_tensors

import k3jax
from k3jax.checkpoint import convert as convert_module
from k3jax.checkpoint import orbax_format
from k3jax.checkpoint.convert import convert, main
from k3jax.checkpoint.orbax_format import MANIFEST
from k3jax.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint
from k3jax.checkpoint.verify import verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def src(oracle_dir, tmp_path):
    return shutil.copytree(oracle_dir / "hf" / "kl_alt", tmp_path / "src")


def _run(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args] + ["--quiet"])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return code, err


def _partial(dst: Path) -> Path:
    return Path(str(dst) + ".partial")


class Interrupted(Exception):
    """Stands for a crash or Ctrl-C in the middle of a conversion."""


def _interrupted_conversion(monkeypatch, src, dst, after: int, **options) -> None:
    """Runs a conversion that stops after `after` tensors, leaving DST.partial with its journal."""
    calls = []
    read = convert_module.read_param_slice

    def read_then_stop(*args):
        calls.append(1)
        if len(calls) > after:
            raise Interrupted
        return read(*args)
    monkeypatch.setattr(convert_module, "read_param_slice", read_then_stop)
    with pytest.raises(Interrupted):
        convert(src, dst, **options)
    monkeypatch.undo()
    assert (_partial(dst) / "progress.jsonl").exists() and not dst.exists()


def test_a_directory_the_converter_did_not_create_is_never_deleted(src, tmp_path, capsys):
    dst, partial = tmp_path / "dst", _partial(tmp_path / "dst")
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")
    code, err = _run(capsys, src, dst)
    assert code == 1 and f"{partial} exists and was not created by" in err
    assert (partial / "notes.txt").read_text() == "mine" and not dst.exists()

    shutil.rmtree(partial)
    partial.write_text("a file, not a directory")
    assert _run(capsys, src, dst)[0] == 1 and partial.read_text() == "a file, not a directory"

    partial.unlink()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "data.txt").write_text("keep")
    partial.symlink_to(tmp_path / "elsewhere")
    assert _run(capsys, src, dst)[0] == 1 and (tmp_path / "elsewhere" / "data.txt").read_text() == "keep"

    partial.unlink()
    partial.mkdir()  # an empty directory holds nothing to lose: it is used
    assert _run(capsys, src, dst)[0] == 0 and not partial.exists()


def test_a_second_conversion_into_the_same_destination_fails_at_once(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    big_kimi_linear_checkpoint(src, experts=256)
    first = subprocess.Popen([sys.executable, "-m", "convert", str(src), str(dst), "--dtype", "float32", "--quiet"],
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    journal = _partial(dst) / "progress.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and first.poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) > 5:
            break
        time.sleep(0.01)
    assert first.poll() is None, "the first conversion ended before the second one started"
    start = time.perf_counter()
    code, err = _run(capsys, src, dst, "--dtype", "bfloat16")
    assert code == 1 and "another conversion into" in err and str(dst) in err
    assert time.perf_counter() - start < 30
    assert first.wait(timeout=300) == 0, first.stdout.read().decode()
    assert json.loads((dst / MANIFEST).read_text())["dtype"] == "float32"
    assert sorted(os.listdir(dst)) == ["config.json", "k3jax.json", "params"]
    verify_checkpoint(dst)


def test_resume_refuses_other_options_and_a_changed_source_then_restart_starts_over(src, tmp_path, capsys,
                                                                                   monkeypatch):
    dst = tmp_path / "dst"
    _interrupted_conversion(monkeypatch, src, dst, after=20, dtype="float32")
    journal = (_partial(dst) / "progress.jsonl").read_text()

    code, err = _run(capsys, src, dst, "--dtype", "bfloat16")
    assert code == 1 and "dtype" in err and "--restart" in err
    rewrite_tensors(src, lambda t: t["model.norm.weight"].__imul__(2))  # same names, shapes and sizes
    code, err = _run(capsys, src, dst, "--dtype", "float32")
    assert code == 1 and "model.safetensors" in err and "--restart" in err
    assert (_partial(dst) / "progress.jsonl").read_text() == journal and not dst.exists()

    assert _run(capsys, src, dst, "--dtype", "float32", "--restart")[0] == 0
    ids = np.random.default_rng(0).integers(0, 512, (1, 6))
    np.testing.assert_array_equal(np.asarray(k3jax.load(dst).logits(ids)), np.asarray(k3jax.load(src).logits(ids)))


def test_resume_of_the_same_source_and_options_reuses_the_work(src, tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    _interrupted_conversion(monkeypatch, src, dst, after=20, dtype="float32", workers=2)
    journal = (_partial(dst) / "progress.jsonl").read_text().splitlines()
    journalled = [json.loads(line).get("tensor") for line in journal]
    report = convert(src, dst, dtype="float32")
    assert report.resumed >= 20 and not _partial(dst).exists()
    ckpt = SafetensorsCheckpoint(src)   # only what the interrupted run left is read
    assert report.bytes_read == ckpt.total_bytes - sum(ckpt.info(n).nbytes for n in journalled if n)
    verify_checkpoint(dst, src)


def test_resume_refuses_another_chunk_layout(src, tmp_path, capsys, monkeypatch):
    """A conversion interrupted under one array layout (read pieces) is not resumed under another."""
    dst = tmp_path / "dst"
    _interrupted_conversion(monkeypatch, src, dst, after=20, dtype="float32")
    monkeypatch.setattr(orbax_format, "READ_PIECES", 4)
    code, err = _run(capsys, src, dst, "--dtype", "float32")
    assert code == 1 and "chunk layout differs" in err and "--restart" in err
    monkeypatch.undo()
    report = convert(src, dst, dtype="float32")
    assert report.resumed >= 20
    verify_checkpoint(dst, src)


@pytest.mark.parametrize("workers", [1, 3])
def test_source_with_non_finite_weights_leaves_nothing(src, tmp_path, capsys, workers):
    bad = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite_tensors(src, lambda t: t[bad].__setitem__((0, 0), np.nan))
    dst = tmp_path / "dst"
    code, err = _run(capsys, src, dst, "--workers", workers)
    assert code == 1 and bad in err and "non-finite" in err
    assert not dst.exists() and not _partial(dst).exists()


def test_failed_verification_leaves_nothing(src, tmp_path, capsys, monkeypatch):
    def failing_verify(dst, src=None, **kwargs):
        raise CheckpointError(f"{dst}: logits differ from the source (simulated)")
    monkeypatch.setattr(convert_module, "verify_checkpoint", failing_verify)
    dst = tmp_path / "dst"
    code, err = _run(capsys, src, dst, "--verify")
    assert code == 1 and "simulated" in err
    assert not dst.exists() and not _partial(dst).exists()


def test_python_m_convert_verify(src, tmp_path):
    dst = tmp_path / "dst"
    convert(src, dst, dtype="float32")
    flip_byte(chunk_files(dst, "model.embed_tokens.embedding")[0])
    out = subprocess.run([sys.executable, "-m", "convert", "verify", str(dst)], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = out.stderr.strip()
    assert out.returncode == 1 and "\n" not in err
    assert err.startswith("python -m convert verify: error:") and "model.embed_tokens.embedding" in err
