"""Two jax.distributed processes on 127.0.0.1: a sharded forward equals one process, and loading a
checkpoint onto an expert-parallel mesh reads each routed expert in exactly one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from tolerances import assert_close

import k3jax
from k3jax.checkpoint.safetensors_io import SafetensorsCheckpoint
from k3jax.checkpoint.writer import save_checkpoint

WORKERS = Path(__file__).resolve().parent.parent / "workers"
WORKER = WORKERS / "multiprocess_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two(worker: Path, *args: str) -> None:
    """Runs the worker as processes 0 and 1 (a fresh coordinator port), failing with their logs."""
    port = free_port()
    # The workers choose their device count; the tests' other XLA flags (a fast CPU compile) pass on.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(port), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(log[-3000:] for log in logs)


def test_two_process_sharded_forward(tmp_path):
    out = tmp_path / "logits.npy"
    run_two(WORKER, str(out))
    ids = np.random.default_rng(0).integers(3, 512, (4, 10))
    single = k3jax.CausalLM.random(k3jax.tiny_kimi_linear(), seed=13).logits(ids)
    assert_close("two processes vs one", np.load(out), single)


def test_each_process_reads_only_its_experts(tmp_path):
    """A Hugging Face checkpoint loaded onto expert=4 over two processes (2 devices each): each routed
    expert tensor is read by exactly one process (the one whose devices hold it), everything else by
    both; the loaded model's logits equal a one-process load of the same files."""
    model = k3jax.CausalLM.random(k3jax.tiny_kimi_linear(num_experts=16), seed=21)
    save_checkpoint(model, tmp_path / "ck", shards=2)
    run_two(WORKERS / "multiprocess_load_worker.py", str(tmp_path / "ck"), str(tmp_path))
    reads = [json.loads((tmp_path / f"read_{i}.json").read_text())["bytes_read"] for i in range(2)]
    ckpt = SafetensorsCheckpoint(tmp_path / "ck")
    expert = sum(ckpt.info(n).nbytes for n in ckpt.names() if ".experts." in n)
    total = sum(ckpt.info(n).nbytes for n in ckpt.names())
    assert expert > total / 2                                   # experts: most of the bytes, as in real models
    assert reads[0] == reads[1] == total - expert / 2, (reads, total, expert)
    single = k3jax.load(tmp_path / "ck", dtype="float32")
    assert single.load_report.bytes_read == total
    ids = np.random.default_rng(0).integers(3, 512, (4, 10))
    assert_close("two-process load vs one", np.load(tmp_path / "logits.npy"), single.logits(ids))
