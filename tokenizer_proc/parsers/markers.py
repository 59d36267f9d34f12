"""Where a marker (a tool-call tag, a reasoning tag) begins in text that is still arriving:
the parsers of this package hold back an end of the text that may begin one until the next
text tells, and read a marker found whole."""

from __future__ import annotations

__all__ = ["WHITESPACE", "held_marker_start", "opening_of_calls", "split_at_marker"]

WHITESPACE = " \t\n\r"


def held_marker_start(text: str, marker: str) -> int:
    """Where the longest end of ``text`` that begins ``marker`` (and is shorter) starts;
    ``len(text)`` when there is none. That end is held back until the next text tells."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return len(text)


def split_at_marker(text: str, marker: str, final: bool) -> tuple[str, str | None, str]:
    """``(content, after, held)``: the content before the first ``marker`` and the text after
    it; without a marker ``after`` is None and ``held`` is an end that may begin one (none at
    the end of the answer, where it is content)."""
    found = text.find(marker)
    if found >= 0:
        return text[:found], text[found + len(marker) :], ""
    cut = len(text) if final else held_marker_start(text, marker)
    return text[:cut], None, text[cut:]


def opening_of_calls(
    text: str, marker: str, final: bool, after_calls: bool
) -> tuple[str | None, str] | None:
    """Text where calls may begin (an answer's start, or the end of a block of calls). None
    while it is only whitespace or the start of ``marker``: hold all of it back. Otherwise
    ``(gap, rest)``: with ``marker`` leading, ``gap`` is the whitespace before it (dropped if
    the block makes a call) and ``rest`` starts at the marker; without, ``gap`` is None and
    ``rest`` is the text to read as content, nothing when it is whitespace after calls."""
    body = text.lstrip(WHITESPACE)
    if not final and marker.startswith(body) and body != marker:
        return None
    if body.startswith(marker):
        return text[: len(text) - len(body)], body
    return None, "" if not body and after_calls else text
