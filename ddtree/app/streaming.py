"""Streaming a generation's text as its tokens arrive: what `generate` and `chat` print."""

from __future__ import annotations

import sys
import time


class Streamer:
    """Prints the newly decoded suffix of the whole generation as tokens arrive (echo=False:
    only collects them, for --jsonl).

    Decoding the whole id list keeps multi-token characters and byte-level merges right; a text
    ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next tokens complete it.
    The arrival times make the summary of a generation that Ctrl-C cut short.
    """

    def __init__(self, tokenizer, echo: bool = True, out=None):
        self.tok = tokenizer
        self.echo = echo
        self.out = out
        self.ids: list[int] = []
        self.printed = ""
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.finished = False

    def _write(self, s: str) -> None:
        out = self.out or sys.stdout
        out.write(s)
        out.flush()

    def _emit(self, text: str) -> None:
        if len(text) > len(self.printed):
            # No Python call between the write and the bookkeeping: a Ctrl-C lands before the write
            # (finish() prints it) or after the bookkeeping, never between them (it would print twice).
            out = self.out or sys.stdout
            try:
                out.write(text[len(self.printed):])
                out.flush()
            finally:
                self.printed = text

    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def __call__(self, toks: list[int]) -> None:
        self.t_last = time.perf_counter()
        if self.t_first is None:
            self.t_first = self.t_last
        self.ids.extend(int(t) for t in toks)
        if self.echo:
            text = self.text()
            if not text.endswith("\ufffd"):
                self._emit(text)

    def finish(self) -> None:
        if self.echo and not self.finished:
            self._emit(self.text())
            self._write("\n")
        self.finished = True
