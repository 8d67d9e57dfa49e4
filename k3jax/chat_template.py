"""Renders a checkpoint's own Jinja chat template the way Hugging Face transformers does, so a
Kimi-Linear prompt (tools and tool calls included) is exactly what the model was trained on.

The environment matches transformers' `apply_chat_template`: a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, the loop-control extension, a `{% generation %}` block (rendered as
its body), `tojson` without HTML escaping (ensure_ascii off, optional indent / separators /
sort_keys), and the globals `raise_exception` and `strftime_now`. Template variables: messages,
tools, add_generation_prompt, plus the tokenizer's special tokens (bos_token, eos_token) and any
extra keyword given.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """A chat template that cannot be rendered for the given messages (the message says why)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    keeps the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None


def render_chat_template(template: str, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """The prompt text for `messages` (OpenAI-style dicts: role, content, tool_calls, ...) and
    optional `tools` (JSON-schema function descriptions). Raises TemplateError on a template error."""
    try:
        return _compile(template).render(**{"documents": None, **variables}, messages=list(messages),
                                         tools=list(tools) if tools else None,
                                         add_generation_prompt=add_generation_prompt)
    except jinja2.exceptions.TemplateError as e:
        raise TemplateError(f"the chat template failed: {e}") from None
