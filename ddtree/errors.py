"""User-facing errors.

A ``DDTreeError`` is a problem the user can fix (a missing file, a bad option, a missing
optional package). Its ``str`` is a single line naming the problem and the fix, e.g.::

    prompt file 'x.jsonl' not found: pass an existing JSONL file or a built-in suite (code, math, chat)

The CLI prints that line and exits with status 2; no traceback is shown.
"""

from __future__ import annotations


class DDTreeError(Exception):
    """A user-facing problem whose message is one line: what is wrong and how to fix it."""

    def __init__(self, message: str) -> None:
        # Keep the message on one line whatever the caller passed.
        message = " ".join(str(message).split())
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class TooLongError(DDTreeError):
    """A generation that would pass the state's --max-length (Decoder.job): chat and serve answer
    it in their own words."""
