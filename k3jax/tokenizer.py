"""Kimi tokenizer: tiktoken BPE with Moonshot's split pattern and 256 reserved special ids (arch §9.1).

A checkpoint directory holds `tiktoken.model` (lines `base64(token) rank`) and
`tokenizer_config.json`, whose `added_tokens_decoder` names the special ids that follow the base
ranks; unnamed reserved ids are `<|reserved_token_{id}|>`. Ordinary text is always encoded with
special-token parsing off, so user text can never forge a structural marker; special tokens are
added by id (`special_id`).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Iterable

import tiktoken

# Moonshot's pre-tokenisation pattern (tokenization_kimi.py `pat_str`): Han runs first, letter runs
# with Han subtracted, 1-3 digit groups, punctuation runs, newlines, trailing and other whitespace.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL = 256
TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be read; the message names the file."""


class KimiTokenizer:
    """Encode/decode with the Kimi BPE. Special ids are base .. base + 255."""

    def __init__(self, ranks: dict[bytes, int], special_names: dict[int, str], *, bos_token: str | None = None,
                 eos_token: str | None = None, name: str = "kimi", chat_template: str | None = None):
        self.num_base = len(ranks)
        if sorted(ranks.values()) != list(range(self.num_base)):
            raise TokenizerError("tiktoken ranks must be exactly 0 .. N-1")
        names = {}
        for i in range(NUM_RESERVED_SPECIAL):
            tid = self.num_base + i
            names[tid] = special_names.get(tid, f"<|reserved_token_{tid}|>")
        self.special_names = names
        self.special_ids = {v: k for k, v in names.items()}
        self.encoding = tiktoken.Encoding(name=name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=self.special_ids)
        self.bos_token_id = self.special_ids.get(bos_token) if bos_token else None
        self.eos_token_id = self.special_ids.get(eos_token) if eos_token else None
        self.chat_template = chat_template  # the checkpoint's Jinja chat template, when it ships one

    @property
    def vocab_size(self) -> int:
        return self.num_base + NUM_RESERVED_SPECIAL

    def special_id(self, name: str) -> int:
        """Id of a named special token, e.g. '<|open|>'. Raises KeyError with the known names."""
        try:
            return self.special_ids[name]
        except KeyError:
            known = [n for n in self.special_ids if not n.startswith("<|reserved_token_")]
            raise KeyError(f"tokenizer has no special token {name!r}; named ones: {known}") from None

    def has_special(self, name: str) -> bool:
        return name in self.special_ids

    def encode(self, text: str) -> list[int]:
        """Ordinary text -> ids; special-token strings inside `text` are encoded as plain text."""
        return self.encoding.encode_ordinary(text)

    def encode_with_specials(self, text: str) -> list[int]:
        """Text whose special-token strings become special ids (a rendered chat template's output,
        as transformers tokenizes it)."""
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the tokenizer's vocabulary [0, {self.vocab_size})")
        if skip_special:
            ids = [i for i in ids if i < self.num_base]
        return self.encoding.decode(ids, errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.encoding.decode_bytes([int(i) for i in ids])

    # ----- files -----
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "KimiTokenizer":
        path = os.fspath(path)
        model_file = os.path.join(path, TIKTOKEN_FILE)
        if not os.path.exists(model_file):
            raise TokenizerError(f"{path}: no {TIKTOKEN_FILE}")
        ranks = {}
        with open(model_file, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except ValueError:
                    raise TokenizerError(f"{model_file}: line {lineno} is not 'base64 rank'") from None
        special, bos, eos, template = {}, None, None, None
        config_file = os.path.join(path, CONFIG_FILE)
        if os.path.exists(config_file):
            try:
                with open(config_file) as f:
                    cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{config_file}: not valid JSON ({e})") from None
            for tid, entry in (cfg.get("added_tokens_decoder") or {}).items():
                special[int(tid)] = entry["content"] if isinstance(entry, dict) else str(entry)
            bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
            template = _default_template(cfg.get("chat_template"))
        template_file = os.path.join(path, TEMPLATE_FILE)
        if os.path.exists(template_file):  # transformers 4.43+ writes the template to its own file
            with open(template_file) as f:
                template = f.read()
        return cls(ranks, special, bos_token=bos, eos_token=eos, name=os.path.basename(path.rstrip("/")) or "kimi",
                   chat_template=template)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        ranks = self.encoding._mergeable_ranks
        with open(os.path.join(path, TIKTOKEN_FILE), "wb") as f:
            for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
                f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
        named = {str(i): {"content": n, "special": True} for i, n in self.special_names.items()
                 if not n.startswith("<|reserved_token_")}
        cfg = {"tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": named,
               "bos_token": self.special_names.get(self.bos_token_id) if self.bos_token_id is not None else None,
               "eos_token": self.special_names.get(self.eos_token_id) if self.eos_token_id is not None else None}
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(cfg, f, indent=1, ensure_ascii=False)


def _token_text(entry) -> str | None:
    if entry is None:
        return None
    return entry["content"] if isinstance(entry, dict) else str(entry)


def _default_template(entry) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (the "default")."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    raise TokenizerError(f"{CONFIG_FILE}: chat_template must be a string or a list of named templates")
