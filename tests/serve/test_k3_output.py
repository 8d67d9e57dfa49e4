"""K3 answer parsing: what the XTML renderer writes for an assistant turn parses back into the
same reasoning, content and tool calls, fed in any piece sizes."""

from __future__ import annotations

import json

import pytest

from k3jax.chat import Special, render_k3
from serve.k3_output import K3AnswerParser

CALLS = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": [1, 2]})}},
         {"id": "c2", "type": "function", "function": {"name": "weather",
                                                       "arguments": json.dumps({"city": 'Zürich "old town" & co'})}},
         {"id": "c3", "type": "function", "function": {"name": "raw", "arguments": "not json at all"}}]


def _assistant_text(message: dict, thinking: bool) -> str:
    """The text the renderer writes for `message` after the assistant prompt (the model's answer)."""
    segments = render_k3([{"role": "user", "content": "q"}, message], thinking=thinking, add_generation_prompt=False)
    text = "".join(s.name if isinstance(s, Special) else s for s in segments)
    start = text.rindex('<|open|>message role="assistant"<|sep|>') + len('<|open|>message role="assistant"<|sep|>')
    opening = "<|open|>think<|sep|>" if thinking else "<|open|>response<|sep|>"
    assert text[start:].startswith(opening)
    return text[start + len(opening):]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("piece", [1, 5, 10_000])
def test_rendered_answer_parses_back(thinking, piece):
    message = {"role": "assistant", "content": "The answer is 4.", "tool_calls": CALLS}
    if thinking:
        message["reasoning_content"] = "Add them; then look up the weather."
    text = _assistant_text(message, thinking)
    parser = K3AnswerParser(thinking)
    streamed = {"reasoning_content": "", "content": ""}
    calls = []
    for i in range(0, len(text), piece):
        deltas, new_calls = parser.feed(text[i:i + piece])
        for name, value in deltas:
            streamed[name] += value
        calls += new_calls
    answer = parser.answer
    assert answer.content == "The answer is 4." == streamed["content"]
    assert answer.reasoning_content == (message.get("reasoning_content", "") if thinking else "")
    assert streamed["reasoning_content"] == answer.reasoning_content
    assert [c.name for c in answer.tool_calls] == ["add", "weather", "raw"] and calls == answer.tool_calls
    assert json.loads(answer.tool_calls[0].arguments) == {"a": 2, "b": [1, 2]}
    assert json.loads(answer.tool_calls[1].arguments) == {"city": 'Zürich "old town" & co'}
    assert answer.tool_calls[2].arguments == "not json at all"
    assert parser.done


def test_text_after_the_message_is_ignored_and_markers_never_leak():
    parser = K3AnswerParser(thinking=False)
    deltas, _ = parser.feed("Hi <|clo")
    assert "".join(v for _, v in deltas) == "Hi "          # a partial marker is held back
    deltas, _ = parser.feed("se|>response<|sep|><|close|>message<|sep|><|end_of_msg|>garbage")
    assert deltas == [] and parser.answer.content == "Hi " and parser.done
