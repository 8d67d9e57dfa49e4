"""Stop strings: which tokens end a row on the device by themselves, and where the text of a
completion ends on the host.

A token whose text contains a stop string ends its row in the compiled loop like a stop id; a stop
string spread over several tokens is found on the host between decode chunks. Either way the text
is cut just before the first occurrence (or after it, when the request includes it) and the token
ids just after the token that completed it.
"""

from __future__ import annotations

import codecs
import functools
from dataclasses import dataclass

MAX_DEVICE_STOP_IDS = 1024  # per row; a stop string inside more tokens than this is matched on the host only


@functools.lru_cache(maxsize=256)
def _token_texts(tokenizer) -> tuple[bytes, ...]:
    return tuple(tokenizer.decode_bytes([i]) for i in range(tokenizer.num_base))


@functools.lru_cache(maxsize=1024)
def tokens_containing(tokenizer, stop: str) -> tuple[int, ...]:
    """Ordinary tokens whose own text contains `stop` (a sampled one ends the completion at once)."""
    needle = stop.encode()
    return tuple(i for i, text in enumerate(_token_texts(tokenizer)) if needle in text)


def device_stop_ids(tokenizer, stops: tuple[str, ...]) -> list[int]:
    """Token ids that end a row on the device for these stop strings (capped)."""
    ids = sorted({i for s in stops for i in tokens_containing(tokenizer, s)})
    return ids[:MAX_DEVICE_STOP_IDS]


def decode_text(tokenizer, token_ids: list[int], skip_special: bool, *, final: bool = True) -> str:
    """The text of `token_ids`; with final=False an incomplete UTF-8 sequence at the end is held back."""
    shown = [t for t in token_ids if t < tokenizer.num_base] if skip_special else token_ids
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(tokenizer.decode_bytes(shown), final=final)


@dataclass(frozen=True)
class StopMatch:
    """Where a completion ends: `tokens` ids kept, `text` kept, the stop string that matched."""

    tokens: int
    text: str
    stop: str


def find_stop(tokenizer, token_ids: list[int], stops: tuple[str, ...], *, skip_special: bool,
              include_stop: bool) -> StopMatch | None:
    """The first occurrence of any stop string in the text of `token_ids`, or None."""
    if not stops:
        return None
    text = decode_text(tokenizer, token_ids, skip_special)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return None
    pos, stop = min(hits)
    end = pos + len(stop)
    low, high = 1, len(token_ids)  # the shortest token prefix whose text holds the whole stop string
    while low < high:
        mid = (low + high) // 2
        if len(decode_text(tokenizer, token_ids[:mid], skip_special, final=False)) >= end:
            high = mid
        else:
            low = mid + 1
    return StopMatch(tokens=low, text=text[:end] if include_stop else text[:pos], stop=stop)
