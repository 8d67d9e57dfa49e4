"""A sharded forward across two jax.distributed processes on 127.0.0.1 equals one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from tolerances import assert_close

import k3jax

WORKER = Path(__file__).resolve().parent.parent / "workers" / "multiprocess_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_sharded_forward(tmp_path):
    port, out = free_port(), tmp_path / "logits.npy"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(out)], env=env,
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
    ids = np.random.default_rng(0).integers(3, 512, (4, 10))
    single = k3jax.CausalLM.random(k3jax.tiny_kimi_linear(), seed=13).logits(ids)
    assert_close("two processes vs one", np.load(out), single)
