"""Hostile and careless input to the Python API and the CLI: one clear error, nothing silently
accepted, Ctrl-C and closed pipes handled. A module meant to keep growing."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoints import builtin_checkpoint

import k3jax

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    return k3jax.load_model("tiny-kimi-linear")


@pytest.mark.parametrize("bad,message", [
    (dict(seed=-1), "seed must be None or an integer in"), (dict(seed=1 << 32), "seed must be None or an integer in"),
    (dict(seed=1.5), "seed must be None or an integer in"), (dict(top_k=1 << 40), "top_k must be an integer"),
    (dict(top_k=True), "top_k must be an integer"), (dict(temperature=float("inf")), "temperature must be a finite"),
    (dict(temperature=float("nan")), "temperature must be a finite"), (dict(temperature="0.5"), "temperature"),
    (dict(stop_token_ids=(-3,)), "stop_token_ids must be non-negative"), (dict(stop_token_ids="2"), "stop_token_ids"),
    (dict(stop_token_ids=(True,)), "stop_token_ids"), (dict(max_new_tokens=1 << 40), "max_new_tokens"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False"), (dict(top_p=float("nan")), "top_p"),
])
def test_sampling_params_refuse_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        k3jax.SamplingParams(**bad)


def test_prompts_of_the_wrong_shape_are_refused(model):
    gen = k3jax.Generator(model)
    with pytest.raises(ValueError, match="single dict"):
        gen.generate({"role": "user", "content": "hi"})
    with pytest.raises(ValueError, match="flat list of integers"):
        gen.generate([[[1, 2], [3, 4]]])
    with pytest.raises(ValueError, match="flat list of integers"):
        gen.generate([[True, False, True]])
    with pytest.raises(ValueError, match="one-dimensional"):
        gen.generate([np.ones((2, 3), np.int32)])
    with pytest.raises(ValueError, match="a prompt must be"):
        gen.generate([3.5])
    with pytest.raises(ValueError, match="stop_token_ids holds id"):
        gen.generate([[5, 6]], k3jax.SamplingParams(stop_token_ids=(model.config.vocab_size,)))
    with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
        gen.generate([[5, 6]], [dict(max_new_tokens=3)])
    with pytest.raises(ValueError, match="integer token ids, got dtype bool"):
        model.logits(np.ones((1, 3), bool))
    with pytest.raises(ValueError, match="rectangular array"):
        model.logits([[1, 2], [3]])


def test_a_huge_top_k_samples_like_no_limit(model):
    gen = k3jax.Generator(model)
    a = gen.generate([[5, 6, 7]], k3jax.SamplingParams(max_new_tokens=6, temperature=1.0, top_k=(1 << 31) - 1, seed=3))
    b = gen.generate([[5, 6, 7]], k3jax.SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    assert a[0].token_ids == b[0].token_ids


def test_requests_that_fit_the_context_are_served(model):
    """4 + 33 tokens on a 64-token model fit, though the buckets (16 + 64) do not."""
    small = model.with_config(dataclasses.replace(model.config, max_position_embeddings=64))
    out = k3jax.Generator(small).generate([[5, 6, 7, 8]], k3jax.SamplingParams(max_new_tokens=33, ignore_eos=True))
    assert len(out[0].token_ids) == 33
    with pytest.raises(ValueError, match="exceeds the context limit 64"):
        k3jax.Generator(small).generate([[5, 6, 7, 8]], k3jax.SamplingParams(max_new_tokens=61))


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory) -> str:
    """tiny-k3-random's first four layers as a checkpoint directory: the CLI processes compile a few
    layers, not thirteen."""
    return str(builtin_checkpoint(tmp_path_factory.mktemp("cli") / "model", "tiny-k3-random", 4))


def _cli(model, *args, **popen):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "k3jax", "generate", "--model", model, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, **popen)


def test_ctrl_c_stops_within_a_chunk_keeps_the_text_and_exits_130(k3_dir):
    proc = _cli(k3_dir, "--prompt", "The quick brown fox", "--max-new-tokens", "16000", "--stream", "--ignore-eos")
    first = proc.stdout.read(4)          # streaming has begun (the compile is behind us)
    assert first, proc.stderr.read().decode()[-2000:]
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - sent
    assert proc.returncode == 130, err.decode()[-2000:]
    assert elapsed < 3.0, f"took {elapsed:.1f} s to stop"
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert lines[-1].startswith("k3jax generate: interrupted after") and "Traceback" not in err.decode()
    assert "tokens, abort" in out.decode()  # the result line of the interrupted prompt


def test_a_closed_output_pipe_gives_one_line(k3_dir):
    proc = _cli(k3_dir, "--prompt", "The quick brown fox", "--max-new-tokens", "16000", "--stream", "--ignore-eos")
    assert proc.stdout.read(4)
    proc.stdout.close()                  # the reader went away (`| head -c 4`)
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert proc.returncode == 2, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == \
        "k3jax generate: error: output closed while writing (broken pipe)"
