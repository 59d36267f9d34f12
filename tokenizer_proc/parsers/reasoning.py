"""Split a chat completion's output into reasoning and content as it streams, and count the
reasoning tokens once the answer is finished.

The chat route makes one :class:`ReasoningParser` per choice (:func:`make_reasoning_parser`,
which states each dialect's rule) and feeds it every text delta as the detokenizer sends it.
The text is split at the tags (``<think>``, ``</think>``), which are dropped from both sides;
after :meth:`ReasoningParser.finish`, :attr:`ReasoningParser.span` says where the reasoning
text lies in the output, and :func:`count_reasoning_tokens` counts the answer's tokens
against it.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from tokenizer_proc.parsers.markers import held_marker_start

__all__ = [
    "DEFAULT_THINK",
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ThinkTags",
    "count_reasoning_tokens",
    "make_reasoning_parser",
    "reasoning_enabled",
]

REASONING_PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3")


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """The texts that open and close the reasoning."""

    start: str
    end: str

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError(
                f"reasoning tags must not be empty, got start {self.start!r} and end {self.end!r}"
            )


DEFAULT_THINK = ThinkTags("<think>", "</think>")


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What one feed (or the finish) adds to each side; either may be empty."""

    reasoning: str
    content: str


_NOTHING = ReasoningDelta("", "")


class _Phase(Enum):
    START = "start"  # nothing yet says whether the output opens with the start tag
    UNDECIDED = "undecided"  # qwen3 without an opening tag: reasoning only if an end tag comes
    REASONING = "reasoning"
    CONTENT = "content"  # past the end tag, or no parsing at all


def count_reasoning_tokens(
    token_bytes: Sequence[bytes], text: str, span: tuple[int, int] | None
) -> int:
    """The tokens whose bytes overlap the reasoning's. ``token_bytes``: each token's raw
    bytes, ``b""`` for one the detokenizer skipped; their concatenation is ``text``'s UTF-8.
    ``span``: :attr:`ReasoningParser.span`, in characters of ``text``; None (no reasoning)
    counts nothing.

    Token i covers ``[a_i, b_i)`` with ``a_0 = 0`` and ``b_i = a_i + len(bytes_i)``; the
    reasoning covers ``[S, E)``, the UTF-8 offsets of the span's ends. A token counts when
    ``a_i < E`` and ``b_i > S``; a zero-byte token (a special token the detokenizer skipped)
    when ``S <= a_i < E``; an empty reasoning has no tokens. With single-token tags
    (``<think>`` is one token in the Qwen3 and DeepSeek tokenizers) that is exactly the tokens
    strictly between the tag tokens; with tags spelled in several tokens, a token that
    straddles a tag's edge counts. It runs once, one pass over the finished answer's ids, so
    it is exact and the same whether the answer was streamed or not, however the output was
    cut into rows."""
    if span is None or span[0] >= span[1]:
        return 0  # no reasoning, or an empty one: no bytes to overlap
    first, stop = _byte_span(b"".join(token_bytes), text, span)  # S, E
    count = 0
    at = 0  # a_i
    for raw in token_bytes:
        if at >= stop:
            break  # every later token starts at or after the reasoning's end
        after = at + len(raw)  # b_i
        if after > first if raw else at >= first:
            count += 1
        at = after
    return count


def _byte_span(raw: bytes, text: str, span: tuple[int, int]) -> tuple[int, int]:
    """``span`` (characters of ``text``) as offsets into ``raw``, the tokens' bytes. ``text``
    is ``raw`` decoded, where a broken UTF-8 sequence (a model can write one) shows as one
    U+FFFD, three bytes in ``text`` whatever it stands for in ``raw``: then the offsets come
    from decoding ``raw`` again."""
    start, end = span
    if "\ufffd" in text:
        starts = _char_starts(raw)
        if len(starts) == len(text):
            starts.append(len(raw))  # the end of the text
            return starts[start], starts[end]
    first = len(text[:start].encode())
    return first, first + len(text[start:end].encode())


def _char_starts(raw: bytes) -> list[int]:
    """Where each character of ``raw.decode("utf-8", "replace")`` starts in ``raw``."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    starts: list[int] = []
    pending = 0  # where the bytes not decoded yet start
    for i in range(len(raw) + 1):
        out = decoder.decode(raw[i : i + 1], final=i == len(raw))
        # The first character began with the pending bytes; one emitted with it (after a
        # broken sequence) is the byte just fed.
        starts.extend([pending] + [i] * (len(out) - 1) if out else [])
        pending = i + 1 - len(decoder.getstate()[0])
    return starts


class ReasoningParser:
    """One choice's split of text into reasoning and content, fed delta by delta.

    Invariant: feeding any cut of the same text gives the same concatenated reasoning and
    content, and the same :attr:`span`, as one feed of all of it; every decision depends on
    the text so far, and text that the next delta may change waits. ``enabled=False`` is the
    pass-through (qwen3 with thinking off).

    In every dialect, text after the first ``</think>`` is content, verbatim (the newline the
    models write after the tag included, and any later ``</think>``); a ``<tool_call>`` inside
    the reasoning is reasoning text, so a tool parser, which sees only content, never sees it.
    Text that may be the beginning of a tag (a trailing ``</thi``) is held back until the next
    text settles it; at the finish it goes to the side it was on.

    Hot path: per delta, one ``str.find`` over the held-back text and the delta while inside
    reasoning, a pass-through after it.
    """

    __slots__ = (
        "_consumed",
        "_finished",
        "_held",
        "_phase",
        "_pieces",
        "_region_end",
        "_region_start",
        "_span",
        "_starts_in_reasoning",
        "_tail",
        "_text_len",
        "_think",
    )

    def __init__(
        self, think: ThinkTags, starts_in_reasoning: bool, *, enabled: bool = True
    ) -> None:
        self._think = think
        self._starts_in_reasoning = starts_in_reasoning
        self._phase = _Phase.START if enabled else _Phase.CONTENT
        self._finished = False
        # Positions are characters of the output text as fed (tags included).
        self._text_len = 0  # all text fed
        self._consumed = 0  # where ``_held`` begins: text before it is sent or dropped
        self._held = ""  # START: a beginning of the start tag; REASONING: of the end tag
        self._pieces: list[str] = []  # UNDECIDED: all text since the start, held
        self._tail = ""  # UNDECIDED: its last len(end tag) - 1 characters, for the search
        self._region_start = 0  # where the reasoning text starts
        self._region_end: int | None = None  # where the end tag starts, once found
        self._span: tuple[int, int] | None = None  # set by finish

    @property
    def span(self) -> tuple[int, int] | None:
        """The reasoning text's ``[start, end)`` in characters of the whole output text (tags
        included), so ``output[start:end]`` is all the reasoning deltas joined; None when the
        answer has no reasoning. Known only after :meth:`finish`."""
        if not self._finished:
            raise RuntimeError("ReasoningParser.span before finish: the reasoning may still grow")
        return self._span

    def feed(self, text: str) -> ReasoningDelta:
        """One text delta of the output."""
        if self._finished:
            raise RuntimeError("ReasoningParser.feed after finish: a parser serves one output")
        self._text_len += len(text)
        return self._split(text)

    def finish(self) -> ReasoningDelta:
        """The held-back text, on the side it was on; :attr:`span` is set by this."""
        self._finished = True
        phase, held = self._phase, self._held
        self._phase, self._held = _Phase.CONTENT, ""
        if phase is _Phase.UNDECIDED:
            text = "".join(self._pieces)
            self._pieces.clear()
            return ReasoningDelta("", text)
        if phase is _Phase.REASONING or phase is _Phase.START and self._starts_in_reasoning:
            self._span = (self._region_start, self._text_len)  # cut off while thinking
            return ReasoningDelta(held, "")
        if self._region_end is not None:
            self._span = (self._region_start, self._region_end)
        return ReasoningDelta("", held)

    def _split(self, text: str) -> ReasoningDelta:
        phase = self._phase
        if phase is _Phase.CONTENT:
            return ReasoningDelta("", text) if text else _NOTHING
        if phase is _Phase.REASONING:
            return self._in_reasoning(text)
        if phase is _Phase.UNDECIDED:
            return self._undecided(text)
        return self._at_start(text)

    def _at_start(self, text: str) -> ReasoningDelta:
        """Whether the output opens with the start tag; held while it may."""
        held = self._held + text
        start = self._think.start
        if held.startswith(start):
            self._held = ""
            self._consumed = self._region_start = len(start)
            self._phase = _Phase.REASONING
            return self._in_reasoning(held[len(start) :])
        if start.startswith(held):
            self._held = held
            return _NOTHING
        self._held = ""
        if self._starts_in_reasoning:
            self._phase = _Phase.REASONING
            return self._in_reasoning(held)
        self._phase = _Phase.UNDECIDED
        return self._undecided(held)

    def _in_reasoning(self, text: str) -> ReasoningDelta:
        buf = self._held + text
        end = self._think.end
        found = buf.find(end)
        if found >= 0:
            self._region_end = self._consumed + found
            self._consumed += len(buf)
            self._held = ""
            self._phase = _Phase.CONTENT
            return ReasoningDelta(buf[:found], buf[found + len(end) :])
        sent = held_marker_start(buf, end)
        self._consumed += sent
        self._held = buf[sent:]
        return ReasoningDelta(buf[:sent], "") if sent else _NOTHING

    def _undecided(self, text: str) -> ReasoningDelta:
        """Hold everything until the first end tag says it was reasoning."""
        end = self._think.end
        window = self._tail + text
        found = window.find(end)
        if found < 0:
            self._pieces.append(text)
            self._tail = window[max(0, len(window) - (len(end) - 1)) :]
            return _NOTHING
        held = "".join(self._pieces) + text
        at = len(held) - len(window) + found  # the window is the end of ``held``
        self._pieces.clear()
        self._tail = ""
        self._region_end = self._consumed + at
        self._consumed += len(held)
        self._phase = _Phase.CONTENT
        return ReasoningDelta(held[:at], held[at + len(end) :])


def make_reasoning_parser(
    name: str, *, enable_thinking: bool = True, think: ThinkTags = DEFAULT_THINK
) -> ReasoningParser:
    """A parser of the named dialect (vLLM's parsers of the same names); ``enable_thinking``
    is the request's ``chat_template_kwargs`` value, which only ``qwen3`` reads.

    - ``deepseek_r1``: the R1 chat template ends the prompt with ``<think>\\n``, so the output
      starts inside reasoning: everything before the first ``</think>`` is reasoning, the
      rest content; no ``</think>`` at all makes everything reasoning. A ``<think>`` the model
      writes at the very start anyway is dropped; one anywhere else is text.
      ``enable_thinking`` is ignored, as by the R1 template.
    - ``qwen3``: with ``enable_thinking=False`` nothing is parsed: all text is content and no
      token is a reasoning token. With thinking on, output that starts with ``<think>``
      (nothing before it) is reasoning up to the first ``</think>``, content after it; no
      ``</think>`` makes all of it after ``<think>`` reasoning (a reply cut off while
      thinking). In output that does not start with ``<think>``, reasoning is the text before
      the first ``</think>`` (templates from Qwen3-2507 open ``<think>`` in the prompt); with
      no ``</think>`` at all it is all content. Which of the two it is stays open until the
      first ``</think>`` or :meth:`ReasoningParser.finish`, and the parser holds all of that
      text back until then: such a reply streams nothing until its ``</think>`` arrives, or
      all at once at the finish when none does."""
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}: expected one of {', '.join(REASONING_PARSERS)}"
        )
    return ReasoningParser(
        think,
        starts_in_reasoning=name == "deepseek_r1",
        enabled=reasoning_enabled(name, enable_thinking),
    )


def reasoning_enabled(name: str, enable_thinking: bool) -> bool:
    """Whether the named dialect reads reasoning out of an answer: always, but for qwen3 with
    ``enable_thinking=False`` (its template closes the reasoning in the prompt)."""
    return enable_thinking or name != "qwen3"
