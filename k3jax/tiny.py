"""Built-in tiny models, so everything runs on a fresh machine without downloads:

- "tiny-k3": a tiny K3 trained on the Python standard library (weights and tokenizer shipped in
  k3jax/models/tiny_k3, checked against their SHA-256 sums on load; scripts/train_tiny_k3.py);
- "tiny-k3-random", "tiny-kimi-linear": deterministic random weights plus a small Kimi-layout
  tokenizer trained offline on an embedded corpus (the tests' models).

    model = k3jax.load_model("tiny-k3"); model.tokenizer
"""

from __future__ import annotations

import dataclasses
import functools
from importlib import resources

from tiktoken._educational import bpe_train

from k3jax.config import ModelConfig, tiny_k3, tiny_kimi_linear
from k3jax.tokenizer import KimiTokenizer

# Special-token layout after the base ranks (arch §9.1): offset -> name.
K3_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
               6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>",
               19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 65: "<osagent_mode>",
               254: "[UNK]", 255: "[PAD]"}
KIMI_LINEAR_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                        6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                        11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
                        13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
                        17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A model reads a prompt, one token at a time, and
writes the next token. Linear attention keeps a small state per head; full attention keeps every
key and value. Kimi Delta Attention decays its state, then corrects it with the delta rule.
Experts are small feed-forward networks; a router picks a few of them for every token.
Hello, world! How are you today? I'm fine, thanks. We're testing: 1, 2, 3, 42, 2026.
def add(a, b):
    return a + b
for i in range(10):
    print(i)
你好，世界！今天天气很好。我们在测试一个小模型。
"""

BUILTIN = ("tiny-k3-random", "tiny-kimi-linear")
# Built-in trained models: name -> directory under k3jax/models/ (a Hugging Face checkpoint in the
# released layout, its tokenizer, the training record and SHA256SUMS). Trained by
# scripts/train_tiny_k3.py; see the README.md in the directory.
TRAINED = {"tiny-k3": "tiny_k3"}
CHECKSUMS = "SHA256SUMS"
EVAL_SLICE = "eval_slice.txt"

# The K2-family chat template (arch §9.3) the built-in Kimi-Linear tokenizer ships
# (k3jax/templates/kimi_linear_chat.jinja), in the form released checkpoints use: tools declared in a
# system message, tool calls in a section of call / argument markers, tool results as messages of
# role "tool". Loading a real checkpoint uses that checkpoint's own template instead.
KIMI_LINEAR_CHAT_TEMPLATE = (resources.files("k3jax") / "templates" / "kimi_linear_chat.jinja").read_text()



@functools.lru_cache(maxsize=None)
def tiny_tokenizer(family: str = "kimi_k3", base_vocab: int = 400) -> KimiTokenizer:
    """A byte-level BPE trained on the embedded corpus, with the family's special-token layout."""
    # Training uses a GPT-4-style split (the training pattern does not enter the model file);
    # encoding then uses Moonshot's pattern, as the real tokenizer does.
    train_pattern = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                     r"""|\s*[\r\n]|\s+(?!\S)|\s+""")
    ranks = bpe_train(_CORPUS, base_vocab, train_pattern, visualise=None)
    layout = K3_SPECIALS if family == "kimi_k3" else KIMI_LINEAR_SPECIALS
    eos = "<|end_of_msg|>" if family == "kimi_k3" else "<|im_end|>"
    specials = {len(ranks) + off: name for off, name in layout.items()}
    template = None if family == "kimi_k3" else KIMI_LINEAR_CHAT_TEMPLATE
    return KimiTokenizer(ranks, specials, bos_token="[BOS]", eos_token=eos, name=f"tiny-{family}",
                         chat_template=template)


def builtin_config(name: str) -> tuple[ModelConfig, KimiTokenizer]:
    if name == "tiny-k3-random":
        tok = tiny_tokenizer("kimi_k3")
        cfg = tiny_k3(vocab_size=tok.vocab_size)
    elif name == "tiny-kimi-linear":
        tok = tiny_tokenizer("kimi_linear")
        cfg = tiny_kimi_linear(vocab_size=tok.vocab_size)
    else:
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {', '.join(BUILTIN)}")
    cfg = dataclasses.replace(cfg, bos_token_id=tok.bos_token_id, eos_token_id=(tok.eos_token_id,),
                              pad_token_id=tok.special_id("[PAD]"))
    return cfg, tok


def trained_path(name: str) -> str:
    """Directory of a built-in trained model (TRAINED), its files checked against SHA256SUMS."""
    if name not in TRAINED:
        raise ValueError(f"unknown trained built-in model {name!r}; trained models: {', '.join(TRAINED)}")
    path = str(resources.files("k3jax") / "models" / TRAINED[name])
    verify_checksums(path)
    return path


def verify_checksums(path: str) -> None:
    """Raises ValueError naming the first file of `path` whose SHA-256 differs from SHA256SUMS."""
    import hashlib
    import os
    with open(os.path.join(path, CHECKSUMS)) as f:
        for line in f:
            digest, fname = line.split()
            with open(os.path.join(path, fname), "rb") as g:
                if hashlib.sha256(g.read()).hexdigest() != digest:
                    raise ValueError(f"{path}/{fname}: SHA-256 differs from {CHECKSUMS}")


def eval_slice_loss(model, path: str) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) of `model` over the shipped held-out slice of `path`
    ([BOS] + the slice's tokens, one row), and the number of predicted tokens."""
    import os

    import jax
    import numpy as np
    with open(os.path.join(path, EVAL_SLICE), encoding="utf-8") as f:
        ids = np.asarray([model.tokenizer.bos_token_id] + model.tokenizer.encode(f.read()), np.int32)[None]
    logits = model.logits(ids[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), ids[:, 1:, None], axis=-1)
    return float(nll.mean()), int(nll.size)
