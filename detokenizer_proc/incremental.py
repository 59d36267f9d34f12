"""Incremental detokenization of a whole frame at once.

Per request it keeps the token ids and two offsets (the prefix/read-offset method): the
text of ``ids[prefix:read]`` is already emitted context, and the new text is what
``ids[prefix:]`` decodes to beyond it. Both decodes for every row of a frame go through
two ``decode_batch`` calls, so the per-row Python work is slicing only.

Guarantees: no U+FFFD for an incomplete UTF-8 sequence (such text is held until the
sequence completes, or dropped at the end); stop strings are trimmed (unless
``no_stop_trim``), and while a streaming request has stop strings the last
``len(longest stop) - 1`` characters are held back, so a trim never has to take back
text that was already sent. State is dropped when the request finishes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from pipeline.io_struct import DecodeOptions, FinishReason, FinishStop
from pipeline.sockets import RateLimitedWarning

logger = logging.getLogger("tokenpipe.detokenizer")

_REPLACEMENT = "\ufffd"


@dataclass
class _RequestText:
    options: DecodeOptions
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # everything decoded so far, held-back part included
    sent: int = 0  # characters of ``text`` already emitted
    holdback: int = 0

    def __post_init__(self) -> None:
        if self.options.stream and self.options.stop and not self.options.no_stop_trim:
            self.holdback = max(len(s) for s in self.options.stop) - 1


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._states: dict[int, _RequestText] = {}
        self._unknown = RateLimitedWarning(logger)

    @property
    def num_live(self) -> int:
        return len(self._states)

    def process(
        self,
        req_ids: Sequence[int],
        new_ids: Sequence[Sequence[int]],
        finished: Sequence[FinishReason | None] | None,
        options: Sequence[DecodeOptions | None] | None,
    ) -> list[str]:
        """Returns the text delta of each row, in row order."""
        states: list[_RequestText] = []
        known: list[int] = []  # row indices that have state
        for i, rid in enumerate(req_ids):
            state = self._states.get(rid)
            if state is None:
                opt = options[i] if options is not None else None
                if opt is None:
                    # Not a first row and no state: the request is unknown here (its first
                    # row never came). Pass the row on without text rather than keep state
                    # for an id that may never finish.
                    self._unknown.warn("req_id %d has no decode state and no decode options; its text is dropped", rid)
                    continue
                state = self._states[rid] = _RequestText(opt)
            state.ids.extend(new_ids[i])
            states.append(state)
            known.append(i)

        news = self._decode_rows(states, prefix_only=False)
        prefixes = self._decode_rows(states, prefix_only=True)

        deltas = [""] * len(req_ids)
        for k, (i, state) in enumerate(zip(known, states)):
            reason = finished[i] if finished is not None else None
            new_text, prefix_text = news[k], prefixes[k]
            if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
                state.text += new_text[len(prefix_text) :]
                state.prefix_offset = state.read_offset
                state.read_offset = len(state.ids)
            elif reason is not None:
                # An incomplete UTF-8 sequence at the very end is dropped, never shown.
                state.text += new_text[len(prefix_text) :].rstrip(_REPLACEMENT)
            deltas[i] = self._take_delta(state, reason)
            if reason is not None:
                del self._states[req_ids[i]]
        return deltas

    def _decode_rows(self, states: list[_RequestText], *, prefix_only: bool) -> list[str]:
        out = [""] * len(states)
        for skip in (True, False):
            rows = [i for i, s in enumerate(states) if s.options.skip_special_tokens is skip]
            if not rows:
                continue
            seqs = [
                states[i].ids[states[i].prefix_offset : states[i].read_offset]
                if prefix_only
                else states[i].ids[states[i].prefix_offset :]
                for i in rows
            ]
            for i, text in zip(rows, self._tokenizer.decode_batch(seqs, skip_special_tokens=skip)):
                out[i] = text
        return out

    @staticmethod
    def _take_delta(state: _RequestText, reason: FinishReason | None) -> str:
        if reason is None:
            end = max(state.sent, len(state.text) - state.holdback)
        else:
            end = len(state.text)
            if isinstance(reason, FinishStop) and isinstance(reason.matched, str) and not state.options.no_stop_trim:
                at = state.text.find(reason.matched, max(0, state.sent - len(reason.matched) + 1))
                if at >= state.sent:
                    end = at
                elif at >= 0:
                    end = state.sent  # the stop began in text already sent; send nothing more
        delta = state.text[state.sent : end]
        state.sent = end
        return delta
