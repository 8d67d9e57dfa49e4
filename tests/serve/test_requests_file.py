"""Batch-job input: both line forms, every malformed line an error request (never a crash),
duplicate ids refused up front, the scan's hash and engine needs, derived seeds."""

from __future__ import annotations

import hashlib
import json

import pytest

from k3jax.sampling import SamplingParams
from serve.requests_file import Defaults, InputError, derive_seed, parse_line, read_requests, scan

DEFAULTS = Defaults(SamplingParams(max_tokens=20), seed=7)


def parse(obj, line: int = 1, defaults: Defaults = DEFAULTS):
    raw = obj if isinstance(obj, bytes) else (json.dumps(obj) + "\n").encode()
    return parse_line(raw, line, defaults)


def test_openai_chat_line():
    r = parse({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "ignored", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 5,
                        "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\n", "logprobs": True, "top_logprobs": 2,
                        "chat_template_kwargs": {"thinking": False}, "user": "u1"}}, line=4)
    assert r.error is None and r.key == "id:a" and r.id == "a" and r.line == 4 and r.chat
    assert r.prompt == [{"role": "user", "content": "Hi"}] and r.chat_options == {"thinking": False}
    sp = r.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed, sp.stop, sp.logprobs) == (5, 0.5, 0.9, 3, ("\n",), 2)


def test_plain_line_takes_the_defaults_and_a_derived_seed():
    r = parse({"id": 12, "prompt": [5, 6, 7], "temperature": 1.0, "stop": None})
    assert r.error is None and r.key == "id:12" and r.id == 12 and not r.chat and r.prompt == [5, 6, 7]
    assert r.sampling.max_tokens == 20 and r.sampling.stop == ()
    assert r.sampling.seed == derive_seed(7, "id:12") == parse({"id": 12, "prompt": "x"}).sampling.seed
    assert derive_seed(8, "id:12") != r.sampling.seed  # the job seed enters


def test_completion_logprobs_as_an_integer():
    r = parse({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": "hi", "logprobs": 3}})
    assert r.error is None and r.sampling.logprobs == 3 and not r.chat


@pytest.mark.parametrize("raw,code,message", [
    (b"not json\n", "invalid_json", "not valid JSON"),
    (b"\xff\xfe{}\n", "invalid_json", "not UTF-8"),
    (b"[1, 2]\n", "invalid_json", "must be a JSON object"),
    (b'{"prompt": "hi"}\n', "invalid_request", "missing or invalid 'id'"),
    (b'{"custom_id": "", "body": {}}\n', "invalid_request", "missing or invalid 'custom_id'"),
    (b'{"id": true, "prompt": "hi"}\n', "invalid_request", "missing or invalid 'id'"),
])
def test_lines_without_a_usable_id_are_keyed_by_line(raw, code, message):
    r = parse_line(raw, 9, DEFAULTS)
    assert r.key == "line:9" and r.id is None and r.error_code == code and message in r.error


@pytest.mark.parametrize("obj,message", [
    ({"custom_id": "a", "body": {"prompt": "x"}, "extra": 1}, "unsupported field 'extra'"),
    ({"custom_id": "a", "method": "GET", "body": {"prompt": "x"}}, "method must be POST"),
    ({"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x"}}, "url must be"),
    ({"custom_id": "a", "url": "/v1/chat/completions", "body": {"prompt": "x"}}, "takes 'messages'"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
     "takes 'prompt'"),
    ({"custom_id": "a", "body": "x"}, "'body' must be a JSON object"),
    ({"id": "a"}, "exactly one of 'prompt' and 'messages'"),
    ({"id": "a", "prompt": "x", "messages": []}, "exactly one of"),
    ({"id": "a", "prompt": ["x", "y"]}, "one prompt per request"),
    ({"id": "a", "prompt": 5}, "'prompt' must be"),
    ({"id": "a", "messages": []}, "non-empty list of message objects"),
    ({"id": "a", "messages": {"role": "user"}}, "non-empty list of message objects"),
    ({"id": "a", "prompt": "x", "temprature": 0.5}, "unsupported field 'temprature'"),
    ({"id": "a", "prompt": "x", "stream": True}, "stream is not supported"),
    ({"id": "a", "prompt": "x", "tools": [{"type": "function"}]}, "apply to chat requests"),
    ({"id": "a", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 3}, "must be a JSON object"),
    ({"id": "a", "prompt": "x", "max_tokens": 4, "max_completion_tokens": 5}, "differ"),
    ({"id": "a", "prompt": "x", "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"id": "a", "prompt": "x", "max_tokens": "10"}, "max_tokens must be a positive integer"),
    ({"id": "a", "prompt": "x", "temperature": -1}, "temperature must be a finite number"),
    ({"id": "a", "prompt": "x", "seed": -5}, "seed must be None or an integer"),
    ({"id": "a", "prompt": "x", "stop": 5}, "'stop' must be a list or a string"),
    ({"id": "a", "prompt": "x", "stop_token_ids": 5}, "'stop_token_ids' must be a list"),
    ({"id": "a", "prompt": "x", "stop": [1]}, "stop must be a string or a list"),
    ({"id": "a", "prompt": "x", "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"id": "a", "prompt": "x", "logprobs": 2, "top_logprobs": 2}, "logprobs: k alone"),
    ({"id": "a", "prompt": "x", "logprobs": 99}, "logprobs must be None or an integer"),
])
def test_bad_requests_keep_their_id_and_say_why(obj, message):
    r = parse(obj)
    assert r.key == "id:a" and r.id == "a" and r.error_code == "invalid_request", r
    assert message in r.error and r.sampling is None


def test_blank_lines_are_no_requests():
    assert parse_line(b"\n", 1, DEFAULTS) is None and parse_line(b"  \r\n", 2, DEFAULTS) is None


def write(path, lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                              for line in lines))
    return str(path)


def test_scan_reports_keys_hash_and_engine_needs(tmp_path):
    path = write(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, b"", b"garbage",
                                         {"id": "b", "prompt": "y", "logprobs": 3},
                                         {"id": "c", "prompt": "y", "presence_penalty": 0.5}])
    s = scan(path, DEFAULTS)
    assert s.keys == {"id:a": 1, "line:3": 3, "id:b": 4, "id:c": 5} and s.count == 4
    assert s.penalties and s.max_logprobs == 3
    assert s.sha256 == hashlib.sha256(open(path, "rb").read()).hexdigest()
    plain = scan(write(tmp_path / "plain.jsonl", [{"id": "a", "prompt": "x"}]), DEFAULTS)
    assert not plain.penalties and plain.max_logprobs is None


def test_duplicate_ids_are_refused_up_front(tmp_path):
    path = write(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"custom_id": "b", "body": {"prompt": "x"}},
                                         {"id": "b", "prompt": "y", "bogus": 1}])
    with pytest.raises(InputError, match=r"duplicate id 'b' on lines 2 and 3"):
        scan(path, DEFAULTS)
    with pytest.raises(InputError, match="duplicate id '1' on lines 1 and 2"):  # 1 and "1" are one id
        scan(write(tmp_path / "in2.jsonl", [{"id": 1, "prompt": "x"}, {"id": "1", "prompt": "x"}]), DEFAULTS)


def test_unreadable_inputs(tmp_path):
    with pytest.raises(InputError, match="cannot read .*missing.jsonl"):
        scan(str(tmp_path / "missing.jsonl"), DEFAULTS)
    with pytest.raises(InputError, match="not a regular file"):
        scan(str(tmp_path), DEFAULTS)


def test_read_requests_filters_by_key_in_file_order(tmp_path):
    path = write(tmp_path / "in.jsonl", [{"id": i, "prompt": "x"} for i in range(10)])
    got = [r.id for r in read_requests(path, DEFAULTS, lambda key: int(key[3:]) % 3 == 0)]
    assert got == [0, 3, 6, 9]
