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
    assert report.resumed == len([n for n in journalled if n]) > 0 and not _partial(dst).exists()
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
    assert report.resumed > 0
    verify_checkpoint(dst, src)


def test_resume_refuses_a_partial_written_one_expert_per_file(src, tmp_path, capsys, monkeypatch):
    """A conversion interrupted under the former layout (a file per expert) is not resumed into files of
    several experts."""
    dst = tmp_path / "dst"
    monkeypatch.setattr(orbax_format, "EXPERTS_PER_FILE", 1)
    _interrupted_conversion(monkeypatch, src, dst, after=40, dtype="float32")
    code, err = _run(capsys, src, dst, "--dtype", "float32")
    assert code == 1 and "chunk layout differs" in err and "--restart" in err
    assert _run(capsys, src, dst, "--dtype", "float32", "--restart")[0] == 0
    verify_checkpoint(dst, src)


def _chunk_bytes(root: Path) -> dict[str, bytes]:
    """Every array's metadata and chunk files (not Orbax's timestamped checkpoint metadata)."""
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted((root / "params").rglob("*"))
            if f.is_file() and (f.name == "zarr.json" or "c" in f.relative_to(root).parts[2:3])}


@pytest.mark.parametrize("workers", [1, 3])
def test_resume_inside_a_file_of_experts_gives_the_same_checkpoint(src, tmp_path, monkeypatch, workers):
    """Interrupted while a file's experts are being read, after an expert file's tensors were written
    but only partly journalled, and with the journal's last line cut: each resume rewrites whole files
    and ends byte for byte equal to an uninterrupted conversion, its journal readable to the end."""
    clean = tmp_path / "clean"
    convert(src, clean, dtype="float32", progress=False)
    dst = tmp_path / "dst"
    # 1. interrupted after 3 * EXPERTS_PER_FILE + 30 reads: more than the first 22 unstacked tensors plus
    #    what 3 workers can hold in unfinished files, so some expert file is journalled
    _interrupted_conversion(monkeypatch, src, dst, after=3 * orbax_format.EXPERTS_PER_FILE + 30, dtype="float32",
                            workers=workers)
    journal = _partial(dst) / "progress.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    assert any(".experts." in line for line in lines)
    # 2. the last journalled file's tensors partly listed, and a cut line after them
    experts = [i for i, line in enumerate(lines) if ".experts." in line]
    if experts:
        lines = lines[:experts[-1]]
    journal.write_text("".join(lines) + '{"tensor": "model.layers.1.block_sparse_moe.exp')
    # 3. a resume that is interrupted again: its entries follow the last whole line (the cut one is
    #    dropped), so a third run reads all of them. 49 reads: more than 3 workers can have in flight
    #    in unfinished files of up to 16 experts, so some file is journalled
    _interrupted_conversion(monkeypatch, src, dst, after=3 * orbax_format.EXPERTS_PER_FILE + 1, dtype="float32",
                            workers=workers)
    again = journal.read_text().splitlines()
    assert len(again) > len(lines) and all(isinstance(json.loads(line), dict) for line in again)
    report = convert(src, dst, dtype="float32", workers=workers)
    assert report.tensors == len(SafetensorsCheckpoint(src).tensors)
    expected = _chunk_bytes(clean)
    assert sum("/c/" in k for k in expected) > 20 and _chunk_bytes(dst) == expected
    verify_checkpoint(dst, src)


def test_a_file_holds_several_experts(src, tmp_path):
    """A stacked expert weight's zarr3 array: experts_per_file experts a file, one inner chunk each, the
    same chunk shape in Orbax's metadata; files on disk as many as the chunk grid says."""
    dst = tmp_path / "dst"
    convert(src, dst, dtype="float32", progress=False)
    manifest = json.loads((dst / MANIFEST).read_text())["params"]
    name = next(n for n, p in manifest.items() if p["stacked"])
    shape = manifest[name]["shape"]
    meta = json.loads((dst / "params" / name / "zarr.json").read_text())
    per = orbax_format.experts_per_file(shape[0], int(np.prod(shape[1:])) * 4)
    assert 1 < per <= orbax_format.EXPERTS_PER_FILE and shape[0] % per == 0
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [per, *shape[1:]]
    assert meta["codecs"][0]["configuration"]["chunk_shape"][0] == 1
    assert len([f for f in (dst / "params" / name / "c").rglob("*") if f.is_file()]) == shape[0] // per
    orbax_meta = json.loads((dst / "params" / "array_metadatas" / "process_0").read_text())["array_metadatas"]
    assert next(m["array_metadata"]["chunk_shape"] for m in orbax_meta
                if m["array_metadata"]["param_name"] == name) == [per, *shape[1:]]


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
