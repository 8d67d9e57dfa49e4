"""Tokenizer (Kimi split pattern, special layout, files) and chat rendering."""

from __future__ import annotations

import copy
import json

import pytest

from k3jax.chat import Special, encode_chat, render_k3, render_kimi_linear
from k3jax.chat_template import TemplateError, render_chat_template
from k3jax.tiny import KIMI_LINEAR_CHAT_TEMPLATE, tiny_tokenizer
from k3jax.tokenizer import KimiTokenizer, TokenizerError


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer("kimi_k3")



def test_kimi_pattern_splits_han_runs_from_letters(tok):
    import regex

    from k3jax.tokenizer import KIMI_PATTERN
    pat = regex.compile(KIMI_PATTERN, flags=regex.V1)
    assert pat.findall("中文English混合") == ["中文", "English", "混合"]
    assert pat.findall("I'll pay 12345 now!\n\n") == ["I'll", " pay", " ", "123", "45", " now", "!\n\n"]
    # And tiktoken, which runs the same pattern in Rust, agrees on the boundaries.
    text = "中文English混合 I'll pay 12345 now!\n\n"
    assert tok.decode(tok.encode(text)) == text


def test_special_layout_and_no_forged_markers(tok):
    base = tok.num_base
    assert tok.vocab_size == base + 256
    assert tok.special_id("[BOS]") == base and tok.special_id("<|end_of_msg|>") == base + 2
    assert tok.special_id("<|open|>") == base + 3 and tok.special_names[base + 8] == f"<|reserved_token_{base + 8}|>"
    assert tok.eos_token_id == base + 2
    forged = tok.encode("<|open|>message<|sep|>")
    assert all(i < base for i in forged)  # user text never becomes a marker
    assert tok.decode(forged) == "<|open|>message<|sep|>"
    with pytest.raises(KeyError, match="no special token"):
        tok.special_id("<|nope|>")
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        tok.decode([tok.vocab_size])


def test_files_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|end_of_msg|>"
    again = KimiTokenizer.from_pretrained(tmp_path)
    text = "Hello, 世界! <|sep|>"
    assert again.encode(text) == tok.encode(text) and again.special_ids == tok.special_ids
    (tmp_path / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(TokenizerError, match="line 1"):
        KimiTokenizer.from_pretrained(tmp_path)


def test_k3_xtml_structure(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": 'Say "hi" & <|close|>'},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "c1", "function": {"name": "echo", "arguments": '{"x": 1, "s": "a"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1 a"},
    ]
    seg = render_k3(messages, thinking=True, thinking_effort="high")
    o, c, s, e = Special("<|open|>"), Special("<|close|>"), Special("<|sep|>"), Special("<|end_of_msg|>")
    assert seg[:3] == [o, 'message role="system" type="thinking-effort"', s]
    i = seg.index('message role="system"')
    assert seg[i - 1:i + 7] == [o, 'message role="system"', s, "Be brief.", c, "message", s, e]
    assert 'message role="user"' in seg and 'Say "hi" & <|close|>' in seg  # text stays text
    j = seg.index('message role="assistant"')
    assert seg[j + 2:j + 12] == [o, "think", s, "Need the tool.", c, "think", s, o, "response", s]
    assert 'call tool="echo" index="1"' in seg
    assert 'argument key="x" type="number"' in seg and 'argument key="s" type="string"' in seg
    assert 'message role="tool" tool="echo" index="1"' in seg
    assert seg[-6:] == [o, 'message role="assistant"', s, o, "think", s]  # generation prompt
    assert render_k3([{"role": "user", "content": "x"}], thinking=False)[-3:] == [o, "response", s]
    no_think = render_k3(messages[2:3], thinking=False, add_generation_prompt=False)
    assert "think" not in no_think
    ids = encode_chat(messages, tok, family="kimi_k3", thinking=True)
    assert ids.count(tok.special_id("<|end_of_msg|>")) == 4
    user = encode_chat([messages[1]], tok, family="kimi_k3", add_generation_prompt=False)
    assert user.count(tok.special_id("<|close|>")) == 1  # the structural one; the user's "<|close|>" is text


def test_attribute_escaping_and_errors():
    seg = render_k3([{"role": "user", "name": 'a"b&c', "content": "x"}], add_generation_prompt=False)
    assert 'message role="user" name="a&quot;b&amp;c"' in seg
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        render_k3([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="thinking_effort"):
        render_k3([{"role": "user", "content": "x"}], thinking_effort="extreme")


def test_kimi_linear_format():
    tok = tiny_tokenizer("kimi_linear")
    seg = render_kimi_linear([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert seg == [Special("<|im_system|>"), "system", Special("<|im_middle|>"), "S", Special("<|im_end|>"),
                   Special("<|im_user|>"), "user", Special("<|im_middle|>"), "U", Special("<|im_end|>"),
                   Special("<|im_assistant|>"), "assistant", Special("<|im_middle|>")]
    bare = copy.copy(tok)
    bare.chat_template = None  # a checkpoint without a template: the built-in K2-family form
    ids = encode_chat([{"role": "user", "content": "U"}], bare, family="kimi_linear")
    assert ids[0] == tok.special_id("<|im_user|>") and ids[-1] == tok.special_id("<|im_middle|>")
    with pytest.raises(ValueError, match="non-empty list"):
        encode_chat([], tok, family="kimi_linear")
    with pytest.raises(ValueError, match="tools need the checkpoint's chat template"):
        encode_chat([{"role": "user", "content": "U"}], bare, family="kimi_linear", tools=[{"type": "function"}])


@pytest.fixture(scope="module")
def chat_cases(oracle_dir):
    return json.loads((oracle_dir / "chat" / "cases.json").read_text())


def test_chat_template_renders_as_transformers_does(chat_cases):
    """The checkpoint-template path against transformers' own Jinja rendering (tools, tool calls,
    content parts, non-ASCII, with and without the generation prompt)."""
    assert chat_cases["template"] == KIMI_LINEAR_CHAT_TEMPLATE
    for name, case in chat_cases["cases"].items():
        ours = render_chat_template(chat_cases["template"], case["messages"], tools=case["tools"],
                                    add_generation_prompt=case["add_generation_prompt"], bos_token="[BOS]",
                                    eos_token="<|im_end|>")
        assert ours == case["rendered"], name


def test_chat_template_tokens_keep_markers_special(chat_cases, tmp_path):
    tok = tiny_tokenizer("kimi_linear")
    tok.save_pretrained(tmp_path / "tok")
    loaded = KimiTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded.chat_template == tok.chat_template  # saved in tokenizer_config.json, read back
    case = chat_cases["cases"]["tools_and_calls"]
    ids = encode_chat(case["messages"], loaded, family="kimi_linear", tools=case["tools"])
    assert loaded.decode(ids) == case["rendered"]
    for marker in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|im_end|>"):
        assert loaded.special_id(marker) in ids  # markers are single special ids, not text
    (tmp_path / "tok" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert KimiTokenizer.from_pretrained(tmp_path / "tok").chat_template.endswith("!")  # the file wins


def test_chat_template_errors_are_one_line():
    with pytest.raises(TemplateError, match="does not parse"):
        render_chat_template("{% for %}", [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="unknown role robot"):
        render_chat_template(KIMI_LINEAR_CHAT_TEMPLATE, [{"role": "robot", "content": "x"}])
