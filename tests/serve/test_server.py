"""The OpenAI-compatible server as a real process on a local port, driven by the official `openai`
client: completions and chat, streamed and not, concurrency, a client that disconnects, bad
requests, the queue limit, and a short load test."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
from checkpoints import builtin_checkpoint

import k3jax
from k3jax.stop_strings import decode_text
from serve.k3_output import K3AnswerParser

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-k3-4-layers"      # the served name of `checkpoint`


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny-k3-random's first four layers (KDA and MLA, dense and MoE, MTP) with its tokenizer."""
    return builtin_checkpoint(tmp_path_factory.mktemp("server") / "model", "tiny-k3-random", 4)


@pytest.fixture(scope="module")
def server(checkpoint):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--model", str(checkpoint), "--served-model-name", MODEL,
                             "--port", str(port), "--max-num-seqs", "8", "--max-model-len", "256", "--max-waiting",
                             "40", "--chunk-steps", "4"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not start: " + proc.stdout.read().decode()[-3000:])
        time.sleep(0.5)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def _client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


@pytest.fixture
def fresh_client(server):
    """A client with its own connection pool, for the tests that open many connections at once. A
    pooled keep-alive connection left idle by an earlier test is closed by the server after 5 s
    (uvicorn's keep-alive timeout); a request sent on it in that instant fails with "Server
    disconnected without sending a response", and these clients do not retry."""
    c = _client(server)
    yield c
    c.close()


@pytest.fixture(scope="module")
def local(checkpoint):
    return k3jax.Generator(k3jax.load_model(checkpoint))


def _metric(server, name: str) -> float:
    with urllib.request.urlopen(server + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"metric {name} missing")


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    text = urllib.request.urlopen(server + "/metrics").read().decode()
    for name in ("k3jax_requests_running", "k3jax_requests_waiting", "k3jax_generation_tokens_per_second",
                 "k3jax_time_to_first_token_seconds_bucket", "k3jax_time_per_output_token_seconds_count"):
        assert name in text


def test_completion_equals_local_generation(client, local):
    expected = local.generate("def fibonacci(n):", k3jax.SamplingParams(max_tokens=12, temperature=0))[0]
    out = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    seeded = [client.completions.create(model=MODEL, prompt="x = ", max_tokens=8, temperature=1.0, seed=5, n=2)
              for _ in range(2)]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    assert len(seeded[0].choices) == 2


def test_chat_streamed_equals_plain_and_parses_the_answer(client, local):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    ref = local.generate([messages], k3jax.SamplingParams(max_tokens=16, skip_special_tokens=False),
                         chat_options={"thinking": True})[0]
    parser = K3AnswerParser(thinking=True)
    parser.feed(decode_text(local.tokenizer, ref.token_ids, False))
    message = plain.choices[0].message
    assert (message.content or "") == parser.answer.content
    assert (message.model_extra.get("reasoning_content") or "") == parser.answer.reasoning_content
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    content, reasoning = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert content == (message.content or "") and reasoning == (message.model_extra.get("reasoning_content") or "")
    no_think = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"chat_template_kwargs": {"thinking": False}})
    assert not no_think.choices[0].message.model_extra.get("reasoning_content")


def test_32_concurrent_requests_equal_their_one_at_a_time_results(client):
    prompts = [f"item {i}: " + "abc " * (i % 7) for i in range(32)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6 + i % 5, temperature=0).choices[0].text
             for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda ip: client.completions.create(
            model=MODEL, prompt=ip[1], max_tokens=6 + ip[0] % 5, temperature=0).choices[0].text,
            enumerate(prompts)))
    assert together == alone


def test_a_client_that_disconnects_frees_its_slot(server, client):
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": MODEL, "prompt": "stream me", "max_tokens": 240, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.read(200)                      # a few events, then the client goes away
    conn.close()
    deadline = time.monotonic() + 20
    while _metric(server, "k3jax_requests_running") > 0:
        assert time.monotonic() < deadline, "the disconnected request kept its slot"
        time.sleep(0.2)
    assert client.completions.create(model=MODEL, prompt="after", max_tokens=3, temperature=0).choices


def test_bad_requests_get_openai_errors(client, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="exceeds this model's context 256"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="context is 256"):
        client.completions.create(model=MODEL, prompt=[5] * 300, max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages="not a list", max_tokens=3)
    request = urllib.request.Request(server + "/v1/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400 and "error" in json.loads(err.value.read())


def test_a_full_queue_answers_429(fresh_client):
    client = fresh_client

    def one(i):
        try:
            client.completions.create(model=MODEL, prompt=f"flood {i}", max_tokens=200, temperature=0,
                                      extra_body={"ignore_eos": True})
            return 200
        except openai.RateLimitError:
            return 429
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        codes = list(pool.map(one, range(64)))
    assert codes.count(429) >= 1 and codes.count(200) >= 8 and set(codes) == {200, 429}


def test_short_load_test(fresh_client, capsys):
    client = fresh_client
    latencies, errors = [], 0
    stop_at = time.monotonic() + 8

    def worker(i):
        nonlocal errors
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            try:
                client.completions.create(model=MODEL, prompt=f"load {i}", max_tokens=8, temperature=0.5, seed=i)
                latencies.append(time.monotonic() - t0)
            except openai.APIError:
                errors += 1
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(worker, range(16)))
    assert errors == 0 and len(latencies) >= 16
    p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
    with capsys.disabled():
        print(f"\nload test: {len(latencies)} requests in 8 s from 16 clients, latency p50 {p50 * 1e3:.0f} ms, "
              f"p90 {p90 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms")
