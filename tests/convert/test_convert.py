"""The conversion CLI: exact results, sharded restore, resumability after SIGKILL, clear errors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoints import big_kimi_linear_checkpoint, snap_experts_to_mxfp4
from tolerances import assert_close

import k3jax
from k3jax.checkpoint.convert import convert, main
from k3jax.checkpoint.verify import verify_checkpoint
from k3jax.checkpoint.orbax_format import MANIFEST
from k3jax.checkpoint.safetensors_io import SafetensorsCheckpoint
from k3jax.checkpoint.writer import save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kimi_linear_converted_equals_direct_load(oracle_dir, tmp_path, dtype):
    src = oracle_dir / "hf" / "kl_mla_first"
    report = convert(src, tmp_path / "out", dtype=dtype, verify=True)
    assert report.tensors == len(SafetensorsCheckpoint(src).names()) and report.skipped == 0
    assert report.bytes_read == SafetensorsCheckpoint(src).total_bytes
    ids = np.load(src / "reference.npz")["input_ids"]
    direct, converted = k3jax.load(src, dtype=dtype), k3jax.load(tmp_path / "out", dtype=dtype)
    np.testing.assert_array_equal(np.asarray(converted.logits(ids)), np.asarray(direct.logits(ids)))
    assert (tmp_path / "out" / "config.json").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("flags", [["--verify"], ["--dequantize-experts"]])
def test_k3_with_mxfp4_experts_and_vision(tmp_path, flags):
    """MXFP4 experts stay packed (uint8 codes and scales) unless dequantised on request; either way
    the logits equal the source model's, and --verify compares them with the source loaded directly."""
    cfg = dataclasses.replace(k3jax.tiny_k3(num_layers=5, attn_res_block_size=2), quantization="mxfp4")
    model = snap_experts_to_mxfp4(k3jax.CausalLM.random(cfg, seed=8))
    save_checkpoint(model, tmp_path / "k3", shards=2, extra_tensors={"vision_tower.w": np.ones(4, np.float32)})
    assert main([str(tmp_path / "k3"), str(tmp_path / "out"), "--dtype", "float32", "--workers", "3",
                 "--quiet", *flags]) == 0
    converted = k3jax.load(tmp_path / "out")
    assert converted.load_report.skipped == 1
    experts = converted.params["model"]["layers"][1]["block_sparse_moe"]["experts"]
    assert ("w1_packed" in experts) == (flags != ["--dequantize-experts"])
    if "w1_packed" in experts:
        assert experts["w1_packed"][...].dtype == np.uint8 and experts["w2_scale"][...].dtype == np.uint8
    ids = np.random.default_rng(1).integers(0, 512, (2, 7))
    np.testing.assert_array_equal(np.asarray(converted.logits(ids)), np.asarray(model.logits(ids)))
    h = np.random.default_rng(2).standard_normal((2, 7, 64)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(converted.mtp(h, ids)[1]), np.asarray(model.mtp(h, ids)[1]))


def test_restores_directly_into_a_mesh(oracle_dir, tmp_path):
    from k3jax.sharding import MeshSpec, make_mesh

    src = oracle_dir / "hf" / "kl_alt"
    convert(src, tmp_path / "out", dtype="float32")
    mesh = make_mesh(MeshSpec(data=2, expert=4))
    model = k3jax.load(tmp_path / "out", mesh=mesh)
    w1 = model.params["model"]["layers"][1]["block_sparse_moe"]["experts"]["w1"][...]
    assert w1.sharding.spec[0] == "expert" and len(w1.addressable_shards) == 8
    ref = np.load(src / "reference.npz")
    assert_close("sharded restore", model.logits(ref["input_ids"]), ref["full_logits"], tol=1e-4)


def test_sigkill_mid_run_then_resume_gives_the_same_result(tmp_path):
    big_kimi_linear_checkpoint(tmp_path / "src", experts=128)
    clean = tmp_path / "clean"
    convert(tmp_path / "src", clean, dtype="float32")
    dst = tmp_path / "dst"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "convert", str(tmp_path / "src"), str(dst), "--dtype", "float32",
                             "--quiet"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    journal = Path(str(dst) + ".partial") / "progress.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) > 40:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the conversion finished before it could be killed"
    assert not dst.exists() and journal.exists()
    report = convert(tmp_path / "src", dst, dtype="float32")
    assert report.resumed > 0
    a = json.loads((clean / MANIFEST).read_text())["params"]
    b = json.loads((dst / MANIFEST).read_text())["params"]
    assert a == b  # same shapes, dtypes and checksums of every parameter
    verify_checkpoint(dst, tmp_path / "src")


@pytest.fixture
def src_copy(oracle_dir, tmp_path):
    shutil.copytree(oracle_dir / "hf" / "kl_alt", tmp_path / "src")
    return tmp_path / "src"


def _run_cli(src, dst, capsys):
    code = main([str(src), str(dst), "--quiet"])
    err = capsys.readouterr().err.strip()
    return code, err


def test_bad_sources_give_one_line_and_no_output(src_copy, tmp_path, capsys):
    dst = tmp_path / "dst"
    data = (src_copy / "model.safetensors").read_bytes()
    (src_copy / "model.safetensors").write_bytes(data[: len(data) - 1000])
    code, err = _run_cli(src_copy, dst, capsys)
    assert code == 1 and "model.safetensors: truncated file" in err and "\n" not in err
    (src_copy / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00notjson!" + data[16:])
    code, err = _run_cli(src_copy, dst, capsys)
    assert code == 1 and "corrupt safetensors header" in err
    (src_copy / "model.safetensors").write_bytes(data)
    (src_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002.safetensors"}}))
    code, err = _run_cli(src_copy, dst, capsys)
    assert code == 1 and "missing: ['model-00002.safetensors']" in err
    os.remove(src_copy / "model.safetensors.index.json")
    cfg = json.loads((src_copy / "config.json").read_text())
    cfg["hidden_size"] = 96
    (src_copy / "config.json").write_text(json.dumps(cfg))
    code, err = _run_cli(src_copy, dst, capsys)
    assert code == 1 and "wrong shape" in err and "model.embed_tokens.weight [512, 64] (expected [512, 96])" in err
    assert not dst.exists() and not Path(str(dst) + ".partial").exists()
    dst.mkdir()
    code, err = _run_cli(src_copy, dst, capsys)
    assert code == 1 and "already exists" in err


def test_k3jax_convert_entry_point(oracle_dir, tmp_path, capsys):
    from k3jax.cli import main as k3jax_main

    assert k3jax_main(["convert", str(oracle_dir / "hf" / "kl_alt"), str(tmp_path / "out"), "--quiet",
                       "--verify"]) == 0
    assert "converted 141 tensors" in capsys.readouterr().out


def test_peak_memory_does_not_grow_with_model_size(tmp_path):
    """Two sources, 8 and 128 experts: the converter's peak RSS moves by far less than the difference."""
    rss = {}
    for experts in (8, 128):
        src = tmp_path / f"src{experts}"
        big_kimi_linear_checkpoint(src, experts)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
                 "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        out = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "convert", str(src),
                              str(tmp_path / f"out{experts}"), "--quiet"], capture_output=True, text=True,
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
        rss[experts] = (int(out.stdout.strip().splitlines()[-1]) * 1024, size)
    grew = rss[128][0] - rss[8][0]
    extra_source = rss[128][1] - rss[8][1]
    assert extra_source > 40e6
    assert grew < 0.25 * extra_source, f"peak RSS grew by {grew / 1e6:.0f} MB for {extra_source / 1e6:.0f} MB more source"
