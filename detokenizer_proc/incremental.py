"""Incremental detokenization of a whole frame at once.

Per request it keeps the token ids and two offsets (the prefix/read-offset method): the
text of ``ids[prefix:read]`` is already emitted context, and the new text is what
``ids[prefix:]`` decodes to beyond it. Both decodes for every row of a frame go through
two ``decode_batch`` calls, so the per-row Python work is slicing only. What the text
guarantees is stated on ``IncrementalDetokenizer``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer, decoders

from pipeline.io_struct import DecodeOptions, FinishReason, FinishStop
from pipeline.finish_reasons import DETOKENIZER_LOST_TEXT
from pipeline.sockets import RateLimitedWarning

logger = logging.getLogger("tokenpipe.detokenizer")

_REPLACEMENT = "\ufffd"


# A UTF-8 character is at most 4 bytes, so an unfinished one has at most 3: a byte that 3
# later bytes have not made part of a character never will be. Counted in bytes, not
# tokens: a skipped special token adds none, and a token may add several.
_MAX_OPEN_BYTES = 3


def _bytes_per_token(tokenizer: Tokenizer, skip_special_tokens: bool) -> bytes:
    """Per token id, how many bytes the token adds to the decoded byte string, at least
    (capped at 255): 0 for a special token that is skipped and for an id the tokenizer does
    not know (``decode`` drops both), its exact length under a byte-level decoder (one
    alphabet character per byte), else 1. Made once, so that counting the bytes of an open
    run is one lookup per token."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    counts = bytearray(size)
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    for token, i in tokenizer.get_vocab(with_added_tokens=False).items():
        if 0 <= i < size:
            counts[i] = min(len(token), 255) if byte_level else 1
    for i, added in tokenizer.get_added_tokens_decoder().items():
        if 0 <= i < size:
            # Kept as text, an added token ends the run before it (decode splits there).
            counts[i] = (
                0
                if skip_special_tokens and added.special
                else max(1, min(len(added.content.encode()), 255))
            )
    return bytes(counts)


class FrameText(NamedTuple):
    """What ``IncrementalDetokenizer.process`` makes of a frame's rows."""

    deltas: list[str]  # each row's text delta, in row order
    # The frame's finish column with every row of a request that has no decode state failed
    # (``DETOKENIZER_LOST_TEXT``); the column as it came (None: no row finishes) otherwise.
    finished: list[FinishReason | None] | None


@dataclass
class _RequestText:
    options: DecodeOptions
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # everything decoded so far, held-back part included
    sent: int = 0  # characters of ``text`` already emitted
    holdback: int = 0
    # While the tail is an open byte run: characters of decode(ids[prefix_offset:]) past
    # the prefix text that are already in ``text`` (settled, though no token boundary
    # after them lets the offsets move).
    settled: int = 0
    stop_search_from: int = 0  # the earliest a matched stop string's occurrence may start

    def __post_init__(self) -> None:
        if self.options.stream and self.options.stop and not self.options.no_stop_trim:
            self.holdback = max(len(s) for s in self.options.stop) - 1


def _trimmed_stop_string(reason: FinishReason | None, state: _RequestText) -> str | None:
    """The stop string whose occurrence ends the text, when it is to be cut off."""
    if (
        isinstance(reason, FinishStop)
        and isinstance(reason.matched, str)
        and not state.options.no_stop_trim
    ):
        return reason.matched
    return None


def _trims_stop_token(reason: FinishReason | None, state: _RequestText) -> bool:
    """A stop token id (or EOS) ends the row it finishes; its text is not output (SGLang
    and vLLM leave it out unless asked to keep it)."""
    return (
        isinstance(reason, FinishStop)
        and isinstance(reason.matched, int)
        and not state.options.no_stop_trim
    )


class IncrementalDetokenizer:
    """The text deltas of every request, frame by frame. Guarantees: no U+FFFD for an
    incomplete UTF-8 sequence while the request runs (such text is held until the sequence
    completes; a byte run that can no longer become a character is released as U+FFFD as
    soon as that is certain, counted in bytes); at the finish the text is the tokenizer's
    decode of the ids, held bytes included, as ``decode`` shows them; a stop token's text and
    a stop string from the occurrence that ended the request on are trimmed (unless
    ``no_stop_trim``), and while a streaming request has stop strings the last
    ``len(longest stop) - 1`` characters are held back, so a trim never has to take back text
    that was already sent. State is dropped when the request finishes. A row of a request
    whose first row never came here (the detokenizer restarted) fails that request
    (``DETOKENIZER_LOST_TEXT``) instead of passing on without its text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._states: dict[int, _RequestText] = {}
        self._unknown = RateLimitedWarning(logger)
        self._run_bytes = {skip: _bytes_per_token(tokenizer, skip) for skip in (True, False)}

    @property
    def num_live(self) -> int:
        return len(self._states)

    def shows_logprob_texts(
        self, req_ids: Sequence[int], options: Sequence[DecodeOptions | None] | None
    ) -> np.ndarray:
        """Per row, whether its request asked for its logprob tokens' texts (a first row
        says so in its options, later rows by the state kept). Called before ``process``,
        which drops the state of the requests that finish."""
        shows = np.zeros(len(req_ids), dtype=bool)
        for i, rid in enumerate(req_ids):
            state = self._states.get(rid)
            opt = (
                state.options if state is not None else options[i] if options is not None else None
            )
            shows[i] = opt is not None and opt.logprob_texts
        return shows

    def process(
        self,
        req_ids: Sequence[int],
        new_ids: Sequence[Sequence[int]],
        finished: list[FinishReason | None] | None,
        options: Sequence[DecodeOptions | None] | None,
    ) -> FrameText:
        """The text delta of each row, and the frame's finish column. The columns must be of
        one length (``pipeline.frame_checks`` checks a frame before it gets here)."""
        rows: list[tuple[int, _RequestText]] = []  # (row index, state) of the rows with state
        lost: list[int] = []
        for i, rid in enumerate(req_ids):
            state = self._states.get(rid)
            if state is None:
                opt = options[i] if options is not None else None
                if opt is None:
                    # Every request's first row carries its options, so this request's first
                    # row never came here: this process restarted since, and its earlier
                    # text is gone. The row fails the request (no text, no state kept)
                    # rather than pass on as if it were the whole output.
                    lost.append(i)
                    continue
                state = self._states[rid] = _RequestText(opt)
            rows.append((i, state))

        states = [st for _, st in rows]
        if finished is None:  # the steady step: nothing ends, nothing is trimmed
            self._advance(states, [new_ids[i] for i, _ in rows], final=False)
        else:
            self._advance(
                states,
                self._chunks_of_finishing_frame(rows, new_ids, finished),
                final=[finished[i] is not None for i, _ in rows],
            )

        deltas = [""] * len(req_ids)
        for i, st in rows:
            reason = finished[i] if finished is not None else None
            deltas[i] = self._take_delta(st, reason)
            if reason is not None:
                del self._states[req_ids[i]]
        if not lost:
            return FrameText(deltas, finished)
        return FrameText(deltas, self._fail_lost(req_ids, lost, finished))

    def _fail_lost(
        self, req_ids: Sequence[int], lost: list[int], finished: list[FinishReason | None] | None
    ) -> list[FinishReason | None]:
        """The finish column with the ``lost`` rows failed. Rare: only after a restart."""
        self._unknown.warn(
            "%d rows have no decode state (req_ids %s...): their requests began before this "
            "detokenizer started, and fail with a 503",
            len(lost),
            [req_ids[i] for i in lost[:5]],
        )
        column: list[FinishReason | None] = (
            list(finished) if finished is not None else [None] * len(req_ids)
        )
        for i in lost:
            column[i] = DETOKENIZER_LOST_TEXT
        return column

    def _chunks_of_finishing_frame(
        self,
        rows: list[tuple[int, _RequestText]],
        new_ids: Sequence[Sequence[int]],
        finished: Sequence[FinishReason | None],
    ) -> list[Sequence[int]]:
        """The ids each row adds, less a stop token that is trimmed. A matched stop string
        ends in its row's last token (the scheduler checks after every token), so its
        occurrence starts past the text of the tokens before it: those are decoded first
        here, and the trim searches from where their text ends."""
        split = [
            (i, st)
            for i, st in rows
            if _trimmed_stop_string(finished[i], st) is not None and len(new_ids[i]) > 1
        ]
        if split:
            self._advance([st for _, st in split], [new_ids[i][:-1] for i, _ in split], final=False)
        last_only = {i for i, _ in split}
        chunks: list[Sequence[int]] = []
        for i, st in rows:
            ids = new_ids[i][-1:] if i in last_only else new_ids[i]
            if _trimmed_stop_string(finished[i], st) is not None:
                st.stop_search_from = len(st.text)
            elif _trims_stop_token(finished[i], st):
                ids = ids[:-1]
            chunks.append(ids)
        return chunks

    def _advance(
        self,
        states: list[_RequestText],
        chunks: Sequence[Sequence[int]],
        *,
        final: bool | list[bool],
    ) -> None:
        """Appends each state's new ids and the text they complete: two ``decode_batch``
        calls for all rows. A text ending in U+FFFD is an unfinished UTF-8 sequence and is
        held, unless the row is final (then it goes out as the decode shows it: nothing
        can complete it now) or the run has outlived any character (then what can no
        longer change is released)."""
        for st, chunk in zip(states, chunks):
            st.ids.extend(chunk)
        news = self._decode_rows(states, prefix_only=False)
        prefixes = self._decode_rows(states, prefix_only=True)
        for k, st in enumerate(states):
            new_text, prefix_text = news[k], prefixes[k]
            start = len(prefix_text) + st.settled
            if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
                st.text += new_text[start:]
                st.prefix_offset = st.read_offset
                st.read_offset = len(st.ids)
                st.settled = 0
            elif len(new_text) == len(prefix_text):
                # Tokens that add no text (skipped special tokens): nothing is open, so the
                # offsets move past them, and a long run of them costs nothing per row.
                st.read_offset = len(st.ids)
            else:
                if len(st.ids) - st.read_offset > 1:  # a single token past read releases nothing
                    start = self._release_closed_run(st, new_text, start)
                if final if isinstance(final, bool) else final[k]:
                    # No byte can come to complete the run now: it ends the text as the
                    # tokenizer's decode of the ids ends it (U+FFFD for what never formed a
                    # character), so the finished text is that decode, streamed or not.
                    st.text += new_text[start:]

    def _release_closed_run(self, st: _RequestText, new_text: str, start: int) -> int:
        """Releases the part of an open run that later bytes can no longer change: what
        ``ids[prefix:cut]`` decodes to, where at least 3 bytes follow ``cut``, as far as it
        agrees with the whole decode (U+FFFD for bytes that never formed a character, which
        a client should see now, not at the end). Returns where the unreleased text now
        starts. Rare: only rows whose text is held get here."""
        run_bytes = self._run_bytes[st.options.skip_special_tokens]
        ids, after, cut = st.ids, 0, len(st.ids)
        while after < _MAX_OPEN_BYTES:
            cut -= 1
            if cut <= st.read_offset:
                return start  # fewer than 3 bytes past the run's first token: nothing settled
            token = ids[cut]
            after += run_bytes[token] if 0 <= token < len(run_bytes) else 0
        before = self._tokenizer.decode(
            ids[st.prefix_offset : cut], skip_special_tokens=st.options.skip_special_tokens
        )
        agreed = len(os.path.commonprefix([before, new_text]))
        if agreed <= start:
            return start
        st.text += new_text[start:agreed]
        st.settled += agreed - start
        return agreed

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
            matched = _trimmed_stop_string(reason, state)
            if matched is not None:
                at = state.text.find(matched, max(0, state.stop_search_from - len(matched) + 1))
                if at >= state.sent:
                    end = at
                elif at >= 0:
                    end = state.sent  # the stop began in text already sent; send nothing more
        delta = state.text[state.sent : end]
        state.sent = end
        return delta
