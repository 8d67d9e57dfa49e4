"""Reading a box of a stored tensor: the safetensors reader fetches only the box's bytes, each
transform maps a parameter box to the stored box it comes from, and converted checkpoints store
the dimensions a mesh can split in read pieces. Checked against reading everything and cutting.
Also what a load over several processes checks first (the two-process loads themselves are in
tests/k3jax/test_multiprocess.py)."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import jax
import ml_dtypes
import numpy as np
import pytest

import k3jax
from k3jax.checkpoint import loader
from k3jax.checkpoint.convert import convert
from k3jax.checkpoint.mxfp4 import quantize_mxfp4
from k3jax.checkpoint.name_map import TensorRule
from k3jax.checkpoint.orbax_format import (EXPERTS_PER_FILE, FILE_BYTES, READ_PIECES, chunk_shape,
                                          experts_per_file, read_chunk_shape, read_manifest)
from k3jax.checkpoint.plan import read_param_slice, stored_nbytes
from k3jax.checkpoint.safetensors_io import SafetensorsCheckpoint, write_safetensors
from k3jax.checkpoint.transforms import HOOKS
from k3jax.sharding import MeshSpec, make_mesh


def _random_box(rng, shape) -> tuple[slice, ...]:
    box = []
    for n in shape:
        a = int(rng.integers(0, n))
        box.append(slice(a, int(rng.integers(a + 1, n + 1))))
    return tuple(box)


@pytest.fixture
def stored(tmp_path):
    rng = np.random.default_rng(7)
    tensors = {"vec": rng.standard_normal(37).astype(np.float32),
               "mat": rng.standard_normal((23, 41)).astype(ml_dtypes.bfloat16),
               "cube": rng.standard_normal((5, 6, 7)).astype(np.float32),
               "bytes": rng.integers(0, 256, (9, 10, 11), dtype=np.uint8)}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    return SafetensorsCheckpoint(tmp_path), tensors


def test_a_box_reads_only_its_bytes(stored):
    ckpt, tensors = stored
    rng = np.random.default_rng(1)
    for name, value in tensors.items():
        for _ in range(12):
            box = _random_box(rng, value.shape)
            before = ckpt.bytes_read
            got = ckpt.read(name, box)
            np.testing.assert_array_equal(got, value[box])
            assert got.dtype == value.dtype
            assert ckpt.bytes_read - before == value[box].nbytes, (name, box)
    before = ckpt.bytes_read
    np.testing.assert_array_equal(ckpt.read("cube"), tensors["cube"])
    assert ckpt.bytes_read - before == tensors["cube"].nbytes


def test_edge_boxes(stored):
    ckpt, tensors = stored
    cube = tensors["cube"]
    for box in [(slice(None),) * 3, (slice(2, 3), slice(None), slice(None)), (slice(0, 5), slice(1, 2), slice(6, 7)),
                (slice(-2, None), slice(None, -1), slice(3, 1)), (slice(4, 9), slice(0, 6), slice(0, 7))]:
        np.testing.assert_array_equal(ckpt.read("cube", box), cube[box])


@pytest.mark.parametrize("region", [(slice(0, 2),), (slice(0, 2), slice(None), slice(0, 4, 2)),
                                    (0, slice(None), slice(None))])
def test_a_region_that_is_not_a_box_is_refused(stored, region):
    ckpt, _ = stored
    with pytest.raises(ValueError, match="not one step-1 slice per axis"):
        ckpt.read("cube", region)


def _hook_cases(rng):
    """(hook, stored tensor(s), parameter shape): every hook the name map uses for parameters a
    mesh can split, and two that read whole."""
    w = rng.standard_normal((12, 20)).astype(np.float32)
    conv = rng.standard_normal((16, 1, 4)).astype(np.float32)
    packed, scale = quantize_mxfp4(rng.standard_normal((8, 64)).astype(np.float32))
    return [("copy", {"t": w}, (12, 20)),
            ("transpose", {"t": w}, (20, 12)),
            ("conv", {"t": conv}, (4, 16)),
            ("conv", {"t": conv[:, 0]}, (4, 16)),
            ("a_log_per_channel", {"t": w}, (12, 20)),
            ("transpose_uint8", {"t": packed}, (32, 8)),
            ("copy_uint8", {"t": packed}, (8, 32)),
            ("a_log_per_head", {"t": w[:1, :6].reshape(1, 1, 6, 1)}, (6,)),
            ("mxfp4_packed", {"t": packed, "s": scale}, (64, 8))]


def test_each_hook_reads_the_box_of_its_parameter(tmp_path):
    rng = np.random.default_rng(3)
    for case, (hook, tensors, shape) in enumerate(_hook_cases(rng)):
        directory = tmp_path / str(case)
        directory.mkdir()
        write_safetensors(directory / "model.safetensors", tensors)
        ckpt = SafetensorsCheckpoint(directory)
        rule = TensorRule(path=("p",), hook=hook, partner="s" if "s" in tensors else None)
        whole = read_param_slice(ckpt, "t", rule, shape)
        assert whole.shape == shape
        for _ in range(6):
            box = _random_box(rng, shape)
            before = ckpt.bytes_read
            got = read_param_slice(ckpt, "t", rule, shape, box)
            np.testing.assert_array_equal(got, whole[box], err_msg=f"{hook} {box}")
            assert ckpt.bytes_read - before == stored_nbytes(ckpt, "t", rule, shape, box), (hook, box)
            if HOOKS[hook].region is not None:
                assert ckpt.bytes_read - before == whole[box].size * ckpt.info("t").dtype.itemsize


def test_hand_off_hooks_read_whole_groups_of_outputs(tmp_path):
    """The "handoff" layout's gate and up hooks (outputs reordered within each 32): a box over whole groups of 32
    outputs reads just its bytes and equals the whole parameter's box; apply then invert gives the stored bytes."""
    rng = np.random.default_rng(4)
    packed, scale = quantize_mxfp4(rng.standard_normal((64, 96)).astype(np.float32))      # [96, 32], [96, 2]
    cases = [("copy_uint8_hand_off", packed, (96, 32), lambda outs, other: (outs, other)),
             ("transpose_uint8_hand_off", scale, (2, 96), lambda outs, other: (other, outs))]
    for case, (hook, stored, shape, box_of) in enumerate(cases):
        directory = tmp_path / str(case)
        directory.mkdir()
        write_safetensors(directory / "model.safetensors", {"t": stored})
        ckpt = SafetensorsCheckpoint(directory)
        rule = TensorRule(path=("p",), hook=hook)
        whole = read_param_slice(ckpt, "t", rule, shape)
        np.testing.assert_array_equal(HOOKS[hook].invert(whole), stored)
        for outs, other in [(slice(0, 32), slice(None)), (slice(32, 96), slice(1, 2)), (slice(64, 96), slice(0, 1))]:
            box = box_of(outs, other)
            before = ckpt.bytes_read
            np.testing.assert_array_equal(read_param_slice(ckpt, "t", rule, shape, box), whole[box], err_msg=hook)
            assert ckpt.bytes_read - before == whole[box].size


def test_read_pieces_of_split_dimensions():
    assert read_chunk_shape((512, 64), stacked=False, split=(0,)) == (512 // READ_PIECES, 64)
    assert read_chunk_shape((64, 96), stacked=False, split=(1,)) == (64, 6)               # 96: 16 pieces
    assert read_chunk_shape((64, 6), stacked=False, split=(1,)) == (64, 3)                # 6: 2 pieces
    assert read_chunk_shape((64, 7), stacked=False, split=(1,)) == (64, 7)                # odd: whole
    assert read_chunk_shape((64, 48), stacked=False) == (64, 48)                          # nothing split
    assert read_chunk_shape((16, 64, 32), stacked=True, split=(0,)) == (1, 64, 32)        # one expert a read
    assert read_chunk_shape((16, 64, 32), stacked=True, split=(1,)) == (1, 4, 32)


def test_files_hold_several_experts():
    """Stacked expert weights: up to EXPERTS_PER_FILE experts a file (a divisor of the count) within
    FILE_BYTES, one inner chunk each, so reads stay per expert while a conversion writes far fewer files."""
    assert (EXPERTS_PER_FILE, FILE_BYTES) == (16, 64 << 20)
    assert [experts_per_file(e, 1 << 20) for e in (896, 256, 112, 48, 18, 8, 7, 1)] == [16, 16, 16, 16, 9, 8, 7, 1]
    assert chunk_shape((896, 3072, 1792), True, 1) == (8, 3072, 1792)           # K3's packed codes: 5.5 MB
    assert chunk_shape((896, 112, 3072), True, 1) == (16, 112, 3072)            # their scales
    assert chunk_shape((896, 3584, 3072), True, 2) == (2, 3584, 3072)           # dequantised bf16: 22 MB
    assert chunk_shape((4, 8192, 8192), True, 4) == (1, 8192, 8192)             # over the cap alone
    assert chunk_shape((64, 48), False, 4) == (64, 48)


def test_one_read_per_contiguous_run_and_short_reads_are_continued(stored, monkeypatch):
    """A box cut on the last axis is one read per row of it, one cut only on the first axis is one
    read; reads the kernel returns short (over 2 GB on Linux) are continued."""
    ckpt, tensors = stored
    calls = []
    real = os.preadv

    def short_preadv(fd, buffers, offset):
        (view,) = buffers
        calls.append(len(view))
        return real(fd, [view[:100]], offset)     # at most 100 bytes a call

    monkeypatch.setattr(os, "preadv", short_preadv)
    box = (slice(1, 4), slice(2, 5), slice(3, 7))    # 3 x 3 runs of 4 values
    np.testing.assert_array_equal(ckpt.read("cube", box), tensors["cube"][box])
    assert len(calls) == 9
    calls.clear()
    np.testing.assert_array_equal(ckpt.read("cube", (slice(1, 4), slice(None), slice(None))), tensors["cube"][1:4])
    assert calls[0] == 3 * 6 * 7 * 4 and len(calls) == -(-3 * 6 * 7 * 4 // 100)   # one run, continued


@pytest.fixture
def converted(oracle_dir, tmp_path):
    convert(oracle_dir / "hf" / "kl_alt", tmp_path / "cv", dtype="float32")
    return tmp_path / "cv"


def test_a_conversion_without_read_pieces_warns_when_a_mesh_spans_processes(converted, caplog):
    manifest = read_manifest(converted)
    assert manifest["read_pieces"] == READ_PIECES
    two_processes = SimpleNamespace(devices=np.array([SimpleNamespace(process_index=i) for i in (0, 1)]))
    one_process = make_mesh(MeshSpec(tensor=2), jax.devices()[:2])
    old = {k: v for k, v in manifest.items() if k != "read_pieces"}      # as an older k3jax wrote it
    with caplog.at_level(logging.WARNING, logger="k3jax.checkpoint.loader"):
        for m, mesh in ((manifest, two_processes), (old, one_process), (old, None)):
            loader._warn_of_whole_reads(converted, m, mesh)
        assert not caplog.records
        loader._warn_of_whole_reads(converted, old, two_processes)
    assert any("before arrays were stored in read pieces" in r.getMessage() for r in caplog.records)


def test_a_mesh_without_this_process_is_refused(converted, oracle_dir, monkeypatch):
    mesh = make_mesh(MeshSpec(tensor=2), jax.devices()[:2])   # process 0's devices
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    for path in (converted, oracle_dir / "hf" / "kl_alt"):
        with pytest.raises(ValueError, match="the mesh holds none of process 1's devices"):
            k3jax.load(path, mesh=mesh)
