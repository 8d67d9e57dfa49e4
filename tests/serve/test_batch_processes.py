"""The batch job as processes (`python -m serve.batch`): kill -9 mid-job then the same command
gives the uninterrupted output, greedy and sampled; two jax.distributed processes with 4 CPU
devices each, replicas within a process (killed and resumed) and one replica spanning both."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoints import builtin_checkpoint

from serve import batch

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("K3JAX_TEST_CACHE", ROOT / ".cache")) / "jax-compilation"
ENGINE = ["--max-len", "128", "--max-slots", "2", "--chunk-steps", "4", "--no-progress"]  # few compiled shapes


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """tiny-kimi-linear's first two layers (KDA and MLA, dense and MoE) with its tokenizer."""
    return str(builtin_checkpoint(tmp_path_factory.mktemp("batch") / "model", "tiny-kimi-linear", 2))


def requests(n: int) -> list[dict]:
    """Greedy, seeded and seed-derived sampled requests of mixed lengths."""
    out = []
    for i in range(n):
        line = {"id": f"r{i}", "prompt": [3 + i, 17, 40 + 2 * i][: 1 + i % 3], "max_tokens": 6 + (7 * i) % 23,
                "ignore_eos": True}
        if i % 3 == 1:
            line.update(temperature=0.8, seed=100 + i)
        elif i % 3 == 2:
            line.update(temperature=1.0)
        out.append(line)
    return out


def write_input(path: Path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def env(devices: int = 1) -> dict:
    flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), f"--xla_force_host_platform_device_count={devices}"]))
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags,
            "K3JAX_COMPILATION_CACHE": str(CACHE), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}


def job(argv: list[str], devices: int = 1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "serve.batch", *argv], env=env(devices), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            out.append((p.wait(timeout=300), p.stdout.read()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return out


def wait_for_parts(output: Path, count: int, procs: list[subprocess.Popen]) -> None:
    parts = Path(str(output) + ".job") / "parts"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if parts.is_dir() and len([p for p in parts.iterdir() if p.name.startswith("r")]) >= count:
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError("the job ended before it was killed:\n" + "\n".join(p.stdout.read() for p in procs))
        time.sleep(0.02)
    raise AssertionError("no parts were committed in time")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_process(tmp_path: Path, model: str, inp: str, mesh: str) -> bytes:
    """The same job in this test process (8 CPU devices): the reference output."""
    out = tmp_path / f"reference-{mesh}.jsonl"
    argv = ["--model", model, "--input", inp, "--output", str(out), "--mesh", mesh, *ENGINE]
    assert batch.main(argv) == 0
    return out.read_bytes()


def test_kill_9_mid_job_then_the_same_command_gives_the_uninterrupted_output(tmp_path, model):
    inp = write_input(tmp_path / "in.jsonl", requests(18))
    argv = lambda out: ["--model", model, "--input", inp, "--output", str(out), "--mesh", "data=1",
                        "--commit-every", "2", *ENGINE]
    [(rc, log)] = finish([job(argv(tmp_path / "clean.jsonl"))])
    assert rc == 0, log[-3000:]
    out = tmp_path / "out.jsonl"
    victim = job(argv(out))
    wait_for_parts(out, 2, [victim])
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not out.exists() and (tmp_path / "out.jsonl.job" / "parts").is_dir()
    [(rc, log)] = finish([job(argv(out))])
    assert rc == 0, log[-3000:]
    assert "this run: " in log and "this run: 18 requests" not in log      # the committed ids were skipped
    assert out.read_bytes() == (tmp_path / "clean.jsonl").read_bytes()
    assert len(out.read_text().splitlines()) == 18


def two_processes(model: str, inp: str, out: Path, mesh: str, extra=()) -> list[subprocess.Popen]:
    port = free_port()
    return [job(["--model", model, "--input", inp, "--output", str(out), "--mesh", mesh, *ENGINE,
                 "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                 *extra], devices=4) for i in range(2)]


def test_two_processes_with_a_replica_each_killed_and_resumed(tmp_path, model):
    inp = write_input(tmp_path / "in.jsonl", requests(16))
    mesh = "data=2,expert=2,tensor=2"       # replica 0 on process 0's four devices, replica 1 on process 1's
    out = tmp_path / "out.jsonl"
    procs = two_processes(model, inp, out, mesh, ["--commit-every", "1"])
    wait_for_parts(out, 2, procs)
    procs[1].send_signal(signal.SIGKILL)    # one process dies; the launcher takes the other one down
    procs[1].wait()
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()
    assert not out.exists()
    results = finish(two_processes(model, inp, out, mesh))
    assert [rc for rc, _ in results] == [0, 0], "\n---\n".join(log[-3000:] for _, log in results)
    assert "16 requests (0 failed)" in results[0][1] and "16 requests" not in results[1][1]  # process 0 reports
    assert out.read_bytes() == in_process(tmp_path, model, inp, mesh)


def test_one_replica_spanning_two_processes_runs_in_lockstep(tmp_path, model):
    inp = write_input(tmp_path / "in.jsonl", requests(8))
    mesh = "data=1,expert=4,tensor=2"       # one model over all eight devices of both processes
    out = tmp_path / "out.jsonl"
    results = finish(two_processes(model, inp, out, mesh))
    assert [rc for rc, _ in results] == [0, 0], "\n---\n".join(log[-3000:] for _, log in results)
    assert out.read_bytes() == in_process(tmp_path, model, inp, mesh)
