"""The OpenAI-compatible HTTP API over the engine service: /v1/models, /v1/completions,
/v1/chat/completions (plain and server-sent-event streams, with usage), /health and /metrics.

Errors come back as OpenAI error bodies: 400 for bad parameters or a prompt longer than the
context, 404 for an unknown model, 429 when the queue is full. A client that goes away cancels its
request, which frees its slot at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from k3jax.engine import EngineUpdate
from k3jax.outputs import CompletionOutput
from k3jax.requests import encode_prompt
from k3jax.stop_strings import decode_text, find_stop
from serve.engine_service import EngineService, QueueFull
from serve.k3_output import K3AnswerParser
from serve.protocol import ChatCompletionRequest, CompletionRequest, prompts_of

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def _error(status: int, message: str, kind: str, param=None, code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


@dataclass
class _Choice:
    """Streaming state of one completion: tokens so far, text sent, the K3 parser when chat on K3."""

    index: int
    tokens: list[int] = field(default_factory=list)
    sent: int = 0
    parser: K3AnswerParser | None = None
    finished: bool = False


class OpenAIServer:
    """Holds the model, its service and the request handling; `app` is the FastAPI application."""

    def __init__(self, service: EngineService, *, model_name: str, max_model_len: int):
        self.service, self.model_name, self.max_model_len = service, model_name, max_model_len
        self.model = service.engine.model
        self.tokenizer = service.engine.tokenizer
        self.k3 = self.model.config.model_type == "kimi_k3"
        self.app = self._build()

    # ----- app -----
    def _build(self) -> FastAPI:
        app = FastAPI(title="k3jax", version="1")

        @app.exception_handler(APIError)
        async def api_error(_, exc: APIError):
            return _error(exc.status, exc.message, exc.kind, exc.param, exc.code)

        @app.exception_handler(RequestValidationError)
        async def validation_error(_, exc: RequestValidationError):
            first = exc.errors()[0] if exc.errors() else {}
            where = ".".join(str(p) for p in first.get("loc", ())[1:])
            return _error(400, f"{where}: {first.get('msg', 'invalid request')}", "invalid_request_error", where)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(self.service.metrics_text(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "k3jax",
                                                "created": 0, "max_model_len": self.max_model_len}]}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self._completions(body, request)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request):
            return await self._chat(body, request)

        return app

    # ----- shared -----
    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           "NotFoundError", "model", "model_not_found")

    def _sampling(self, body, prompt_len: int, requested: int | None, logprobs: int | None, *, skip_special=True):
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {self.max_model_len}",
                           param="messages" if isinstance(body, ChatCompletionRequest) else "prompt")
        max_tokens = room if requested is None else requested
        if max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens} plus the prompt's {prompt_len} tokens exceeds this model's "
                                f"context {self.max_model_len}", param="max_tokens")
        try:
            return body.sampling(max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=skip_special)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def _encode(self, prompt, **chat) -> list[int]:
        try:
            return encode_prompt(self.model, self.tokenizer, prompt, chat_options=chat or None)
        except (ValueError, KeyError) as e:
            raise APIError(400, str(e)) from None

    def _submit(self, prompt_ids: list[int], sampling, prefix: str) -> tuple[str, asyncio.Queue]:
        request_id = self.service.new_id(prefix)
        try:
            return request_id, self.service.submit(request_id, prompt_ids, sampling)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}", "rate_limit_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def _updates(self, request_id: str, queue: asyncio.Queue, request: Request) -> AsyncIterator[EngineUpdate]:
        """The request's engine updates; a client that disconnects cancels it."""
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self.service.cancel(request_id)
                        return
                    continue
                if isinstance(item, Exception):
                    raise APIError(500, f"generation failed: {item}", "server_error")
                yield item
                if item.result is not None:
                    return
        except asyncio.CancelledError:
            self.service.cancel(request_id)
            raise

    def _delta_text(self, choice: _Choice, sampling, new_tokens: list[int], *, specials: bool) -> str:
        """New text of a streamed choice: all tokens decoded, cut at a stop string, the tail that may
        begin a stop string held back until the next update."""
        choice.tokens += new_tokens
        text = decode_text(self.tokenizer, choice.tokens, not specials, final=False)
        match = find_stop(self.tokenizer, choice.tokens, sampling.stop, skip_special=not specials,
                          include_stop=sampling.include_stop_str_in_output) if sampling.stop else None
        if match is not None:
            text, choice.finished = match.text, True
        elif sampling.stop:
            text = text[:max(choice.sent, len(text) - (max(map(len, sampling.stop)) - 1))]
        delta, choice.sent = text[choice.sent:], max(choice.sent, len(text))
        return delta

    def _final_text(self, choice: _Choice, out: CompletionOutput, specials: bool) -> str:
        text = decode_text(self.tokenizer, out.token_ids, not specials) if specials else (out.text or "")
        delta, choice.sent = text[choice.sent:], max(choice.sent, len(text))
        return delta

    @staticmethod
    def _usage(prompt_tokens: int, outputs: list[CompletionOutput]) -> dict:
        completion = sum(len(o.token_ids) for o in outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    # ----- /v1/completions -----
    async def _completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        try:
            prompts = prompts_of(body)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        encoded = [self._encode(p) for p in prompts]
        requested = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        samplings = [self._sampling(body, len(ids), requested, body.logprobs) for ids in encoded]
        submitted = [self._submit(ids, sp, "cmpl") for ids, sp in zip(encoded, samplings)]
        response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name}
        n = body.n
        if body.stream:
            return StreamingResponse(self._stream_completions(base, body, encoded, samplings, submitted, request),
                                     media_type="text/event-stream")
        choices, outputs = [], []
        for p, (request_id, queue) in enumerate(submitted):
            result = None
            async for update in self._updates(request_id, queue, request):
                result = update.result
            if result is None:  # the client went away
                return JSONResponse({}, status_code=499)
            for out in result.outputs:
                outputs.append(out)
                choices.append({"index": p * n + out.index, "text": out.text, "finish_reason": out.finish_reason,
                                "logprobs": self._completion_logprobs(out)})
        return {**base, "choices": choices, "usage": self._usage(sum(map(len, encoded)), outputs)}

    def _completion_logprobs(self, out: CompletionOutput):
        if out.logprobs is None:
            return None
        tokens = [self._token_text(t) for t in out.token_ids]
        return {"tokens": tokens, "token_logprobs": [e[t] for e, t in zip(out.logprobs, out.token_ids)],
                "top_logprobs": [{self._token_text(i): v for i, v in e.items()} for e in out.logprobs],
                "text_offset": [sum(map(len, tokens[:i])) for i in range(len(tokens))]}

    async def _stream_completions(self, base, body, encoded, samplings, submitted, request):
        n, outputs = body.n, []
        for p, ((request_id, queue), sp) in enumerate(zip(submitted, samplings)):
            choices = {c: _Choice(p * n + c) for c in range(n)}
            async for update in self._updates(request_id, queue, request):
                for c, new in update.new_tokens.items():
                    delta = self._delta_text(choices[c], sp, new, specials=False)
                    if delta:
                        yield _sse({**base, "choices": [{"index": choices[c].index, "text": delta, "logprobs": None,
                                                         "finish_reason": None}]})
                if update.result is not None:
                    for out in update.result.outputs:
                        outputs.append(out)
                        yield _sse({**base, "choices": [{"index": choices[out.index].index,
                                                         "text": self._final_text(choices[out.index], out, False),
                                                         "logprobs": self._completion_logprobs(out),
                                                         "finish_reason": out.finish_reason}]})
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": self._usage(sum(map(len, encoded)), outputs)})
        yield "data: [DONE]\n\n"

    # ----- /v1/chat/completions -----
    def _chat_options(self, body: ChatCompletionRequest) -> dict:
        options = dict(body.chat_template_kwargs or {})
        if body.tools:
            options["tools"] = body.tools
        if self.k3:
            if body.reasoning_effort is not None:
                options.setdefault("thinking", body.reasoning_effort != "none")
                if body.reasoning_effort in ("low", "high", "max"):
                    options.setdefault("thinking_effort", body.reasoning_effort)
            if "enable_thinking" in options:
                options["thinking"] = bool(options.pop("enable_thinking"))
        return options

    async def _chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        options = self._chat_options(body)
        thinking = bool(options.get("thinking", True)) if self.k3 else False
        prompt_ids = self._encode(body.messages, **options)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sampling = self._sampling(body, len(prompt_ids), requested, logprobs, skip_special=not self.k3)
        request_id, queue = self._submit(prompt_ids, sampling, "chatcmpl")
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name}
        if body.stream:
            return StreamingResponse(self._stream_chat({**base, "object": "chat.completion.chunk"}, body, prompt_ids,
                                                       sampling, thinking, request_id, queue, request),
                                     media_type="text/event-stream")
        result = None
        async for update in self._updates(request_id, queue, request):
            result = update.result
        if result is None:
            return JSONResponse({}, status_code=499)
        choices = []
        for out in result.outputs:
            message, finish = self._chat_message(out, thinking)
            choices.append({"index": out.index, "message": message, "finish_reason": finish,
                            "logprobs": self._chat_logprobs(out)})
        return {**base, "choices": choices, "usage": self._usage(len(prompt_ids), result.outputs)}

    def _chat_message(self, out: CompletionOutput, thinking: bool) -> tuple[dict, str]:
        if not self.k3:
            return {"role": "assistant", "content": out.text}, out.finish_reason
        parser = K3AnswerParser(thinking, call_id_prefix=f"call_{out.index}")
        parser.feed(decode_text(self.tokenizer, out.token_ids, False))
        answer = parser.answer
        message = {"role": "assistant", "content": answer.content or None,
                   "reasoning_content": answer.reasoning_content or None}
        if answer.tool_calls:
            message["tool_calls"] = [c.as_openai() for c in answer.tool_calls]
        finish = "tool_calls" if answer.tool_calls and out.finish_reason == "stop" else out.finish_reason
        return message, finish

    def _chat_logprobs(self, out: CompletionOutput):
        if out.logprobs is None:
            return None
        content = []
        for token, entry in zip(out.token_ids, out.logprobs):
            text = self._token_text(token)
            content.append({"token": text, "logprob": entry[token], "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self._token_text(i), "logprob": v,
                                              "bytes": list(self._token_text(i).encode())}
                                             for i, v in sorted(entry.items(), key=lambda kv: -kv[1])]})
        return {"content": content}

    async def _stream_chat(self, base, body, prompt_ids, sampling, thinking, request_id, queue, request):
        choices = {c: _Choice(c, parser=K3AnswerParser(thinking, f"call_{c}") if self.k3 else None)
                   for c in range(body.n)}
        for c in choices:
            yield _sse({**base, "choices": [{"index": c, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]})
        outputs = []
        async for update in self._updates(request_id, queue, request):
            for c, new in update.new_tokens.items():
                for chunk in self._chat_deltas(choices[c], self._delta_text(choices[c], sampling, new,
                                                                            specials=self.k3)):
                    yield _sse({**base, "choices": [chunk]})
            if update.result is not None:
                for out in update.result.outputs:
                    outputs.append(out)
                    choice = choices[out.index]
                    for chunk in self._chat_deltas(choice, self._final_text(choice, out, self.k3)):
                        yield _sse({**base, "choices": [chunk]})
                    calls = choice.parser is not None and bool(choice.parser.answer.tool_calls)
                    finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
                    yield _sse({**base, "choices": [{"index": out.index, "delta": {}, "finish_reason": finish,
                                                     "logprobs": self._chat_logprobs(out)}]})
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": self._usage(len(prompt_ids), outputs)})
        yield "data: [DONE]\n\n"

    def _chat_deltas(self, choice: _Choice, text: str) -> list[dict]:
        if not text:
            return []
        if choice.parser is None:
            return [{"index": choice.index, "delta": {"content": text}, "finish_reason": None}]
        deltas, calls = choice.parser.feed(text)
        out = [{"index": choice.index, "delta": {name: piece}, "finish_reason": None} for name, piece in deltas]
        for call in calls:
            position = choice.parser.answer.tool_calls.index(call)
            out.append({"index": choice.index, "finish_reason": None,
                        "delta": {"tool_calls": [{"index": position, **call.as_openai()}]}})
        return out


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
