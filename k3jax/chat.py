"""Chat prompt rendering for both families (arch §9.2, §9.3).

Renderers emit segments: `Special(name)` for structural markers, encoded by id, and plain `str`
for everything else (tag names, attributes, message text), encoded with special-token parsing
off, so user or tool text can never forge a marker (arch §10.38).

K3 "XTML": tags are <|open|>name attrs<|sep|> ... <|close|>name<|sep|>; every message ends with
<|end_of_msg|>. The exact wording of the fixed system texts of the released encoder (tool
declaration preamble, thinking-effort note) is not public in a form we could check; the texts
below follow its structure and are marked as ours.
Kimi-Linear (K2 family): <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from k3jax.chat_template import render_chat_template

THINKING_EFFORTS = ("low", "high", "max")
_TOOLS_PREAMBLE = ("# Tools\n\nThe following tools are available. Each is described by a JSON Schema "
                   "of its parameters.\n")  # k3jax wording; see the module docstring
_NEW_TOOLS_PREAMBLE = "# New Tools Available\n\n"


@dataclass(frozen=True)
class Special:
    """A structural marker, encoded as its special-token id."""

    name: str


Segment = Special | str


def _compact_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI-style content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"{where}: only text content parts are supported, got {part!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


class XTML:
    """Builds K3 XTML segments."""

    def __init__(self):
        self.out: list[Segment] = []

    def open(self, tag: str, **attrs) -> "XTML":
        head = tag + "".join(f' {k}="{_escape(v)}"' for k, v in attrs.items() if v is not None)
        self.out += [Special("<|open|>"), head, Special("<|sep|>")]
        return self

    def close(self, tag: str) -> "XTML":
        self.out += [Special("<|close|>"), tag, Special("<|sep|>")]
        return self

    def text(self, text: str) -> "XTML":
        if text:
            self.out.append(text)
        return self

    def element(self, tag: str, text: str, **attrs) -> "XTML":
        return self.open(tag, **attrs).text(text).close(tag)

    def message(self, text: str, **attrs) -> "XTML":
        self.element("message", text, **attrs)
        self.out.append(Special("<|end_of_msg|>"))
        return self


def _tool_list(tools: Sequence[dict]) -> list:
    return [t.get("function", t) if isinstance(t, dict) else t for t in tools]


def _argument_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string"


def _render_tool_calls(x: XTML, calls: Sequence[dict]) -> None:
    x.open("tools")
    for i, call in enumerate(calls, 1):
        fn = call.get("function", call)
        name, args = fn["name"], fn.get("arguments", {})
        x.open("call", tool=name, index=i)
        parsed = args
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                parsed = None
        if isinstance(parsed, dict):
            for key, value in parsed.items():
                kind = _argument_type(value)
                x.element("argument", value if kind == "string" else _compact_json(value), key=key, type=kind)
        else:
            x.element("json", args if isinstance(args, str) else _compact_json(args), type="object")
        x.close("call")
    x.close("tools")


def render_k3(messages: Sequence[dict], *, tools: Sequence[dict] | None = None, thinking: bool = True,
              thinking_effort: str | None = None, tool_choice: str | None = None,
              response_format: dict | None = None, add_generation_prompt: bool = True) -> list[Segment]:
    """K3 XTML prompt (arch §9.2) as segments."""
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking_effort must be one of {THINKING_EFFORTS}, got {thinking_effort!r}")
    x = XTML()
    if tools:
        x.message(_TOOLS_PREAMBLE + "```json\n" + _compact_json(_tool_list(tools)) + "\n```", role="system",
                  type="tool-declare")
    if thinking and thinking_effort:
        x.message(f"Thinking effort: {thinking_effort}.", role="system", type="thinking-effort")
    # Tool results follow the order of the assistant's tool_calls (matched by tool_call_id).
    call_order: dict[str, tuple[int, str]] = {}
    for i, msg in enumerate(messages):
        role = msg.get("role")
        where = f"messages[{i}]"
        content = _text(msg.get("content"), where)
        if role == "system":
            if msg.get("tools"):
                x.message(_NEW_TOOLS_PREAMBLE + "```json\n" + _compact_json(_tool_list(msg["tools"])) + "\n```",
                          role="system", type="tool-declare")
            if content or not msg.get("tools"):
                x.message(content, role="system", name=msg.get("name"))
        elif role == "user":
            x.message(content, role="user", name=msg.get("name"))
        elif role == "assistant":
            x.open("message", role="assistant", name=msg.get("name"))
            if thinking:
                x.element("think", _text(msg.get("reasoning_content") or msg.get("reasoning"), where))
            x.element("response", content)
            calls = msg.get("tool_calls") or []
            if calls:
                _render_tool_calls(x, calls)
                call_order = {c.get("id", str(j)): (j + 1, c.get("function", c)["name"]) for j, c in enumerate(calls)}
            x.close("message")
            x.out.append(Special("<|end_of_msg|>"))
        elif role == "tool":
            index, name = call_order.get(msg.get("tool_call_id"), (None, msg.get("name")))
            x.message(content, role="tool", tool=name, index=index)
        else:
            raise ValueError(f"{where}: unknown role {role!r} (expected system, user, assistant or tool)")
    if tool_choice in ("required", "none"):
        x.message(f"tool_choice: {tool_choice}", role="system", type="tool-choice")
    if response_format and response_format.get("type") in ("json_object", "json_schema"):
        schema = response_format.get("json_schema", {}).get("schema", {})
        x.message(_compact_json(schema), role="system", type="response-format")
    if add_generation_prompt:
        x.open("message", role="assistant").open("think" if thinking else "response")
    return x.out


def render_kimi_linear(messages: Sequence[dict], *, add_generation_prompt: bool = True, **_unused) -> list[Segment]:
    """K2-family chat format used by Kimi-Linear (arch §9.3)."""
    markers = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>",
               "tool": "<|im_system|>"}
    out: list[Segment] = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role not in markers:
            raise ValueError(f"messages[{i}]: unknown role {role!r} (expected system, user, assistant or tool)")
        out += [Special(markers[role]), msg.get("name") or role, Special("<|im_middle|>"),
                _text(msg.get("content"), f"messages[{i}]"), Special("<|im_end|>")]
    if add_generation_prompt:
        out += [Special("<|im_assistant|>"), "assistant", Special("<|im_middle|>")]
    return out


def encode_segments(segments: Sequence[Segment], tokenizer) -> list[int]:
    """Special markers by id, text with special-token parsing off."""
    ids: list[int] = []
    for seg in segments:
        if isinstance(seg, Special):
            ids.append(tokenizer.special_id(seg.name))
        elif seg:
            ids.extend(tokenizer.encode(seg))
    return ids


def encode_chat(messages: Sequence[dict], tokenizer, *, family: str, **options) -> list[int]:
    """Renders `messages` for `family` and encodes them: K3 through its XTML renderer; Kimi-Linear
    through the checkpoint's own Jinja chat template when the tokenizer carries one (tools and
    tool calls included, exactly as transformers renders it), else the built-in K2-family form."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("a chat prompt must be a non-empty list of {'role': ..., 'content': ...} messages")
    if family == "kimi_k3":
        return encode_segments(render_k3(messages, **options), tokenizer)
    if tokenizer.chat_template is not None:
        text = render_chat_template(tokenizer.chat_template, messages, tools=options.pop("tools", None),
                                    add_generation_prompt=options.pop("add_generation_prompt", True),
                                    bos_token=tokenizer.special_names.get(tokenizer.bos_token_id),
                                    eos_token=tokenizer.special_names.get(tokenizer.eos_token_id), **options)
        return tokenizer.encode_with_specials(text)
    if options.get("tools"):
        raise ValueError("tools need the checkpoint's chat template (tokenizer_config.json has no chat_template)")
    return encode_segments(render_kimi_linear(messages, **options), tokenizer)
