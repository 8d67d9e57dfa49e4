"""The output line of one request, in OpenAI's batch output format:

    {"id": "batch_req_<24 hex>", "custom_id": "a",
     "response": {"status_code": 200, "body": {"id": "chatcmpl-<24 hex>", "object": "chat.completion",
                  "model": "tiny-k3", "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."},
                  "logprobs": null, "finish_reason": "length", "stop_reason": null, "token_ids": [...]}],
                  "usage": {"prompt_tokens": 9, "completion_tokens": 16, "total_tokens": 25}}},
     "error": null}

A `prompt` request gets "object": "text_completion" and choices with "text" instead of "message".
A failed request: "response": null, "error": {"code": ..., "message": ..., "line": <input line>}.
`custom_id` is the request's id (custom_id, or id of the plain form; null for a line without a
readable id). Nothing depends on the clock, so a re-run writes the same bytes: ids are digests of
the request's id, and there is no "created" time.
"""

from __future__ import annotations

import hashlib

from k3jax.outputs import CompletionOutput, GenerationResult

from serve.requests_file import Request


def _digest(request: Request) -> str:
    return hashlib.sha256(request.key.encode()).hexdigest()[:24]


def error_record(request: Request, message: str | None = None, code: str | None = None) -> dict:
    """The record of a request that failed (by default with the error its line carries)."""
    return {"id": "batch_req_" + _digest(request), "custom_id": request.id, "response": None,
            "error": {"code": code or request.error_code or "invalid_request", "message": message or request.error,
                      "line": request.line}}


def result_record(request: Request, result: GenerationResult, model_name: str, tokenizer) -> dict:
    """The record of a request the engine finished."""
    digest = _digest(request)
    completion = sum(len(c.token_ids) for c in result.outputs)
    prompt = len(result.prompt_token_ids)
    body = {"id": ("chatcmpl-" if request.chat else "cmpl-") + digest,
            "object": "chat.completion" if request.chat else "text_completion", "model": model_name,
            "choices": [_choice(request, c, tokenizer) for c in result.outputs],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
    return {"id": "batch_req_" + digest, "custom_id": request.id, "response": {"status_code": 200, "body": body},
            "error": None}


def completion_tokens(record: dict) -> int:
    """Tokens a record's request generated (0 for a failed one)."""
    response = record.get("response")
    return response["body"]["usage"]["completion_tokens"] if response else 0


def _choice(request: Request, c: CompletionOutput, tokenizer) -> dict:
    out = {"index": c.index}
    if request.chat:
        out["message"] = {"role": "assistant", "content": c.text}
    else:
        out["text"] = c.text
    out["logprobs"] = None if c.logprobs is None else _logprobs(c, request.sampling.logprobs, tokenizer)
    out.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason, token_ids=c.token_ids)
    return out


def _logprobs(c: CompletionOutput, k: int, tokenizer) -> dict:
    """OpenAI's chat shape, with the token ids: per token the sampled one and the k most likely."""
    def entry(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token]) if tokenizer is not None else None
        return {"token": text, "token_id": token, "logprob": logprob}

    content = []
    for token, table in zip(c.token_ids, c.logprobs):
        top = sorted(table.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        content.append({**entry(token, table[token]), "top_logprobs": [entry(t, v) for t, v in top]})
    return {"content": content}
