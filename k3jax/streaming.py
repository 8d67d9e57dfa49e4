"""Turns the decode loop's token buffer into per-completion chunks of new tokens and text.

Text is decoded from all of a completion's tokens each time (UTF-8 safe: an incomplete sequence at
the end waits), cut at a matched stop string, and while a completion runs the last
len(longest stop string) - 1 characters are held back, since they may begin a stop string.
"""

from __future__ import annotations

from typing import Callable

from k3jax.outputs import StreamChunk
from k3jax.stop_strings import StopMatch, decode_text


class StreamAdapter:
    """One per generate call. rows: (prompt index, completion index) per batch row; stops and
    skip_special per row."""

    def __init__(self, callback: Callable[[StreamChunk], None], rows: list[tuple[int, int]], tokenizer,
                 stops: list[tuple[str, ...]], skip_special: list[bool]):
        self.callback, self.rows, self.tokenizer = callback, rows, tokenizer
        self.stops, self.skip_special = stops, skip_special
        self.sent_tokens = [0] * len(rows)
        self.sent_text = [0] * len(rows)

    def update(self, tokens, counts, done, matches: dict[int, StopMatch], *, final: bool = False) -> None:
        """Emits what each row generated since the last call (tokens [B, N], counts [B], done [B])."""
        for r, (index, completion) in enumerate(self.rows):
            count = int(counts[r])
            match = matches.get(r)
            if match is not None:
                count = min(count, match.tokens)
            new_ids = tokens[r, self.sent_tokens[r]:count].tolist()
            text = None
            if self.tokenizer is not None:
                if match is not None:
                    full = match.text
                else:
                    finished = final or bool(done[r])
                    full = decode_text(self.tokenizer, tokens[r, :count].tolist(), self.skip_special[r],
                                       final=finished)
                    if not finished and self.stops[r]:
                        full = full[:max(self.sent_text[r], len(full) - (max(map(len, self.stops[r])) - 1))]
                text = full[self.sent_text[r]:]
                self.sent_text[r] = len(full)
            self.sent_tokens[r] = max(self.sent_tokens[r], count)
            if new_ids or text:
                self.callback(StreamChunk(index, new_ids, text, completion))
