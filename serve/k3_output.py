"""Parses K3's XTML answer into OpenAI's fields: `reasoning_content`, `content` and `tool_calls`,
incrementally, so streamed deltas never show a marker.

After a thinking prompt the model writes (arch §9.2):

    reasoning <|close|>think<|sep|> <|open|>response<|sep|> answer <|close|>response<|sep|>
    [<|open|>tools<|sep|> <|open|>call tool="name" index="1"<|sep|>
        <|open|>argument key="k" type="string"<|sep|>value<|close|>argument<|sep|> ...
     <|close|>call<|sep|> ... <|close|>tools<|sep|>] <|close|>message<|sep|> <|end_of_msg|>

and after a non-thinking prompt the same from `answer` on. Text is fed as decoded with its special
markers; anything after the message closes is ignored.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
_MARKERS = (OPEN, CLOSE, "<|end_of_msg|>")
_ATTR = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class ToolCall:
    """One call in OpenAI's shape: id, name and the arguments as a JSON string."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedAnswer:
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def _argument_value(raw: str, kind: str):
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


class K3AnswerParser:
    """Feed decoded text piece by piece; `feed` returns (field, text) deltas ("reasoning_content"
    or "content") and completed tool calls; `answer` holds everything parsed so far."""

    def __init__(self, thinking: bool, call_id_prefix: str = "call"):
        self.channel = "reasoning_content" if thinking else "content"
        self.answer = ParsedAnswer()
        self._buffer = ""
        self._call: dict | None = None
        self._argument: dict | None = None
        self._prefix = call_id_prefix
        self.done = False

    def feed(self, text: str) -> tuple[list[tuple[str, str]], list[ToolCall]]:
        deltas, calls = [], []
        self._buffer += text
        while self._buffer and not self.done:
            start = min((i for i in (self._buffer.find(m) for m in _MARKERS) if i >= 0), default=-1)
            if start < 0:
                keep = self._partial_marker_tail()
                self._emit_text(self._buffer[:len(self._buffer) - keep], deltas)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            self._emit_text(self._buffer[:start], deltas)
            self._buffer = self._buffer[start:]
            if self._buffer.startswith("<|end_of_msg|>"):
                self.done = True
                break
            end = self._buffer.find(SEP)
            if end < 0:
                break  # the tag is not complete yet
            tag = self._buffer[:end + len(SEP)]
            self._buffer = self._buffer[end + len(SEP):]
            call = self._tag(tag)
            if call is not None:
                calls.append(call)
        return deltas, calls

    def _partial_marker_tail(self) -> int:
        """Characters at the end that might begin a marker (held back until the next piece)."""
        for n in range(min(len(self._buffer), max(map(len, _MARKERS)) - 1), 0, -1):
            if any(m.startswith(self._buffer[-n:]) for m in _MARKERS):
                return n
        return 0

    def _emit_text(self, text: str, deltas: list) -> None:
        if not text:
            return
        if self._argument is not None:
            self._argument["value"] += text
        elif self.channel in ("reasoning_content", "content") and self._call is None:
            setattr(self.answer, self.channel, getattr(self.answer, self.channel) + text)
            deltas.append((self.channel, text))

    def _tag(self, tag: str) -> ToolCall | None:
        opening = tag.startswith(OPEN)
        body = tag[len(OPEN if opening else CLOSE):-len(SEP)]
        name, _, attrs = body.partition(" ")
        attrs = {k: html.unescape(v) for k, v in _ATTR.findall(attrs)}
        if opening:
            if name == "response":
                self.channel = "content"
            elif name == "think":
                self.channel = "reasoning_content"
            elif name == "tools":
                self.channel = "tools"
            elif name == "call":
                self._call = {"name": attrs.get("tool", ""), "arguments": {}, "raw": None}
            elif name == "argument" and self._call is not None:
                self._argument = {"key": attrs.get("key", ""), "type": attrs.get("type", "string"), "value": ""}
            elif name == "json" and self._call is not None:
                self._argument = {"key": None, "type": "raw", "value": ""}
            return None
        if name in ("think", "response"):
            self.channel = "between"
        elif name == "argument" and self._argument is not None and self._call is not None:
            self._call["arguments"][self._argument["key"]] = _argument_value(self._argument["value"],
                                                                             self._argument["type"])
            self._argument = None
        elif name == "json" and self._argument is not None and self._call is not None:
            self._call["raw"] = self._argument["value"]
            self._argument = None
        elif name == "call" and self._call is not None:
            arguments = self._call["raw"] if self._call["raw"] is not None else json.dumps(
                self._call["arguments"], ensure_ascii=False)
            call = ToolCall(f"{self._prefix}_{len(self.answer.tool_calls)}", self._call["name"], arguments)
            self.answer.tool_calls.append(call)
            self._call = None
            return call
        elif name == "message":
            self.done = True
        return None
