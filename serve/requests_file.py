"""Batch-job input: one request per JSONL line, parsed into a `Request` (prompt, SamplingParams,
chat options) or into the error a line's record will carry; and the up-front `scan` of the whole
file (duplicate ids, content hash, what the engine must be built for).

Two line forms, with the same request fields:

    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "temperature": 0.7, "seed": 1}}
    {"id": "b", "prompt": "The quick brown fox", "max_tokens": 16, "stop": ["\\n"]}

The first is OpenAI's batch input (`url` /v1/chat/completions needs `messages`, /v1/completions
`prompt`); the second is the plain form (`id` plus the body's fields at the top level). Request
fields: `prompt` (text or token ids) or `messages` (chat), and vLLM's sampling names `max_tokens`
(OpenAI's `max_completion_tokens` too), `n`, `temperature`, `top_p`, `top_k`, `seed`, `stop`,
`stop_token_ids`, `ignore_eos`, `logprobs` (true with `top_logprobs: k`, or an integer k),
`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `skip_special_tokens`,
`include_stop_str_in_output`; chat requests also `tools` and `chat_template_kwargs` (renderer
options, e.g. {"thinking": false}). `model`, `user`, `metadata` and `store` are accepted and
ignored; any other field makes the request an error (a typo must not pass silently). A field set to
null takes its default.

A request without a `seed` gets one derived from the job's seed and its id, so sampled results are
reproducible: a resumed job regenerates exactly what an uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from typing import Callable, Iterator

from k3jax.sampling import SamplingParams

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
SAMPLING_FIELDS = ("max_tokens", "n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens",
                   "include_stop_str_in_output")
IGNORED_FIELDS = ("model", "user", "metadata", "store")
BODY_FIELDS = frozenset(SAMPLING_FIELDS + IGNORED_FIELDS + (
    "prompt", "messages", "max_completion_tokens", "logprobs", "top_logprobs", "stream", "tools",
    "chat_template_kwargs"))
ENVELOPE_FIELDS = frozenset(("custom_id", "method", "url", "body"))


class InputError(ValueError):
    """The input file as a whole cannot be used (unreadable, duplicate ids): the job is refused."""


@dataclass(frozen=True)
class Defaults:
    """What a request leaves out: `sampling` for its sampling fields, `seed` (the job's) to derive
    the seed of a request without one."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0


@dataclass(frozen=True)
class Request:
    """One input line. key: "id:<id>" for a line with an id, "line:<n>" for one without (its error
    record is keyed by its place). `error` (with `error_code`) is why the line cannot run; then
    prompt and sampling are None."""

    line: int
    key: str
    id: str | int | None
    chat: bool = False
    prompt: str | list | None = None
    sampling: SamplingParams | None = None
    chat_options: dict | None = None
    error: str | None = None
    error_code: str | None = None


def derive_seed(job_seed: int, key: str) -> int:
    """The seed of a request that gives none: 32 bits of sha256(job seed, key)."""
    return int.from_bytes(hashlib.sha256(f"{job_seed}:{key}".encode()).digest()[:4], "big")


def _valid_id(value) -> bool:
    return (isinstance(value, str) and value != "") or (isinstance(value, int) and not isinstance(value, bool))


def _bad(line: int, key: str, rid, code: str, message: str) -> Request:
    return Request(line, key, rid, error=message, error_code=code)


def parse_line(raw: bytes, line: int, defaults: Defaults) -> Request | None:
    """The request of one input line (`line` counts from 1), or None for a blank line."""
    if not raw.strip():
        return None
    where = f"line:{line}"
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return _bad(line, where, None, "invalid_json", "the line is not UTF-8 text")
    except json.JSONDecodeError as e:
        return _bad(line, where, None, "invalid_json", f"not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return _bad(line, where, None, "invalid_json", "a request line must be a JSON object")
    openai = "custom_id" in obj or "body" in obj
    name = "custom_id" if openai else "id"
    rid = obj.get(name)
    if not _valid_id(rid):
        return _bad(line, where, None, "invalid_request",
                    f"missing or invalid '{name}' (a non-empty string or an integer)")
    key = "id:" + str(rid)
    try:
        body, url = _envelope(obj) if openai else ({k: v for k, v in obj.items() if k != "id"}, None)
        chat, prompt, chat_options = _prompt(body, url)
        sampling = _sampling(body, defaults, key)
    except ValueError as e:
        return _bad(line, key, rid, "invalid_request", str(e))
    return Request(line, key, rid, chat, prompt, sampling, chat_options)


def _envelope(obj: dict) -> tuple[dict, str | None]:
    unknown = sorted(set(obj) - ENVELOPE_FIELDS)
    if unknown:
        raise ValueError(f"unsupported field '{unknown[0]}' (a batch line holds custom_id, method, url and body)")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, got {obj['method']!r}")
    url = obj.get("url")
    if url is not None and url not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("'body' must be a JSON object")
    return body, url


def _prompt(body: dict, url: str | None) -> tuple[bool, str | list, dict | None]:
    """(chat, prompt, chat options) of a request body."""
    unknown = sorted(set(body) - BODY_FIELDS)
    if unknown:
        raise ValueError(f"unsupported field '{unknown[0]}'")
    if body.get("stream"):
        raise ValueError("stream is not supported in a batch job")
    if ("prompt" in body) == ("messages" in body):
        raise ValueError("give exactly one of 'prompt' and 'messages'")
    chat = "messages" in body
    if url is not None and chat != (url == CHAT_URL):
        raise ValueError(f"{url} takes '{'prompt' if chat else 'messages'}', not '{'messages' if chat else 'prompt'}'")
    if chat:
        prompt = body["messages"]
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
            raise ValueError("'messages' must be a non-empty list of message objects")
    else:
        prompt = body["prompt"]
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) or is_ids):
            raise ValueError("'prompt' must be a string or a list of token ids (one prompt per request)")
    options = {}
    if body.get("tools") is not None:
        options["tools"] = body["tools"]
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ValueError("'chat_template_kwargs' must be a JSON object")
        options.update(kwargs)
    if options and not chat:
        raise ValueError("'tools' and 'chat_template_kwargs' apply to chat requests ('messages')")
    return chat, prompt, options or None


def _sampling(body: dict, defaults: Defaults, key: str) -> SamplingParams:
    values = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    limit = body.get("max_completion_tokens")
    if limit is not None:
        if values.setdefault("max_tokens", limit) != limit:
            raise ValueError("max_tokens and max_completion_tokens differ")
    for name in ("stop", "stop_token_ids"):
        if name in values and not isinstance(values[name], (str, list)):
            raise ValueError(f"'{name}' must be a list{' or a string' if name == 'stop' else ''}")
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if isinstance(logprobs, bool) or logprobs is None:
        if top is not None and not logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        values["logprobs"] = (0 if top is None else top) if logprobs else None
    elif top is not None:
        raise ValueError("give logprobs: true with top_logprobs, or logprobs: k alone")
    else:
        values["logprobs"] = logprobs
    fields = {f.name: getattr(defaults.sampling, f.name) for f in dataclasses.fields(SamplingParams)
              if f.name != "max_new_tokens"}
    fields.update(values)
    if fields["seed"] is None:
        fields["seed"] = derive_seed(defaults.seed, key)
    return SamplingParams(**fields)


@dataclass
class InputScan:
    """What the job needs to know about its whole input before it starts: the content's sha256,
    every request's key (-> its line), and whether any request asks for penalties or logprobs
    (the engine is built for them only then)."""

    sha256: str
    keys: dict[str, int]
    penalties: bool = False
    max_logprobs: int | None = None

    @property
    def count(self) -> int:
        return len(self.keys)


def _open(path: str):
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"cannot read {path}: not a regular file")
        return open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    with _open(path) as f:
        try:
            yield from enumerate(f, 1)
        except OSError as e:
            raise InputError(f"cannot read {path}: {e.strerror or e}") from None


def scan(path: str, defaults: Defaults) -> InputScan:
    """Reads the whole input once. Raises InputError when it cannot be read or holds an id twice."""
    digest = hashlib.sha256()
    out = InputScan("", {})
    for line, raw in _lines(path):
        digest.update(raw)
        request = parse_line(raw, line, defaults)
        if request is None:
            continue
        if request.key in out.keys:
            raise InputError(f"duplicate id {request.id!r} on lines {out.keys[request.key]} and {line} "
                             "(every request needs its own id)")
        out.keys[request.key] = line
        sp = request.sampling
        if sp is not None:
            out.penalties |= sp.penalized
            if sp.logprobs is not None:
                out.max_logprobs = max(out.max_logprobs or 0, sp.logprobs)
    out.sha256 = digest.hexdigest()
    return out


def read_requests(path: str, defaults: Defaults, wanted: Callable[[str], bool]) -> Iterator[Request]:
    """The requests whose key `wanted` accepts, in file order, one line in memory at a time."""
    for line, raw in _lines(path):
        request = parse_line(raw, line, defaults)
        if request is not None and wanted(request.key):
            yield request
