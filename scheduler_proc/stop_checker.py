"""Decides whether a request is finished after a token was appended: max_new_tokens,
EOS (unless ignore_eos), stop token ids and stop strings (docs/design/scheduler.md); and,
before a draw, which tokens a request short of ``min_new_tokens`` may not draw (its stop
token ids and EOS: the sampler bans them, docs/design/sampling.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pipeline.io_struct import FinishLength, FinishReason, FinishStop, SamplingParams
from scheduler_proc.req import Req
from scheduler_proc.sampling.sampler import BannedTokens


# Decodes token ids to text; the flag is ``skip_special_tokens``.
Decode = Callable[[Sequence[int], bool], str]

_REPLACEMENT = "\ufffd"

# What ``check_columns`` says of each row.
RUNNING, STOP_TOKEN, LENGTH, CONTEXT = 0, 1, 2, 3


class StopChecker:
    def __init__(
        self, eos_token_ids: frozenset[int], decode: Decode | None, context_length: int
    ) -> None:
        """``decode`` None: no tokenizer (``--skip-tokenizer-init``), so no stop strings."""
        self._eos = eos_token_ids
        self._eos_ids = np.array(sorted(eos_token_ids), dtype=np.int64)
        self._decode = decode
        self._context_length = context_length
        # (token, skip_special_tokens) -> whether the token alone decodes to no text (a
        # special token that is skipped): at most two entries per vocabulary id.
        self._textless: dict[tuple[int, bool], bool] = {}

    @property
    def matches_stop_strings(self) -> bool:
        return self._decode is not None

    def check(self, req: Req) -> FinishReason | None:
        """Called right after ``req.output_ids`` grew by one token."""
        s = req.sampling
        n = len(req.output_ids)
        token = req.output_ids[-1]
        if n >= s.min_new_tokens:
            if token in s.stop_token_ids:
                return FinishStop(matched=token)
            if not s.ignore_eos and token in self._eos:
                return FinishStop(matched=token)
            if s.stop:
                matched = self._match_stop_string(req)
                if matched is not None:
                    return FinishStop(matched=matched)
        if n >= s.max_new_tokens:
            return FinishLength(length=s.max_new_tokens)
        if req.seq_len >= self._context_length:
            return FinishLength(length=n)
        return None

    def check_columns(
        self,
        new: np.ndarray,
        out_len: np.ndarray,
        seq_len: np.ndarray,
        min_new: np.ndarray,
        max_new: np.ndarray,
        ignore_eos: np.ndarray,
        stop_ids: np.ndarray,
        has_stop_strings: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``check`` for a whole decode step at once, on the running batch's columns (after
        the new token was appended). Returns each row's outcome (RUNNING, STOP_TOKEN,
        LENGTH, CONTEXT) and the rows whose stop strings must still be checked: those go
        through ``check`` one by one, since only text can tell, and its answer wins."""
        may_stop = out_len >= min_new
        hit = (
            (stop_ids == new[:, None]).any(axis=1)
            if stop_ids.shape[1]
            else np.zeros(len(new), dtype=bool)
        )
        if self._eos_ids.size:
            hit |= np.isin(new, self._eos_ids) & ~ignore_eos
        hit &= may_stop
        code = np.where(
            hit,
            STOP_TOKEN,
            np.where(
                out_len >= max_new,
                LENGTH,
                np.where(seq_len >= self._context_length, CONTEXT, RUNNING),
            ),
        )
        return code, has_stop_strings & may_stop & ~hit

    def min_new_bans(
        self, out_len: np.ndarray, min_new: np.ndarray, stop_ids: np.ndarray
    ) -> BannedTokens | None:
        """The tokens each row of a decode step may not draw: while its output (``out_len``
        tokens before this draw) is shorter than ``min_new``, its stop ids (``stop_ids``,
        the running batch's table, padded with -1) and EOS. Column work; None at once when
        no row is short (the steady step). EOS is banned with ``ignore_eos`` too, as SGLang
        and vLLM do (their min-tokens ban takes every stop id and EOS)."""
        short = out_len < min_new
        if not short.any():
            return None
        rows = np.flatnonzero(short)
        table = stop_ids[rows]
        if self._eos_ids.size:
            eos = np.broadcast_to(self._eos_ids, (rows.size, self._eos_ids.size))
            table = np.concatenate((table, eos), axis=1)
        keep = table >= 0
        if not keep.any():
            return None
        return BannedTokens(np.broadcast_to(rows[:, None], table.shape)[keep], table[keep])

    def min_new_bans_of(
        self, params: Sequence[SamplingParams], out_lens: Sequence[int]
    ) -> BannedTokens | None:
        """``min_new_bans`` for draws outside the running batch (a first token, a dLLM
        pass): draw i is of output index ``out_lens[i]`` under ``params[i]``."""
        rows: list[int] = []
        ids: list[int] = []
        eos = self._eos_ids.tolist()
        for i, (s, n) in enumerate(zip(params, out_lens)):
            if n < s.min_new_tokens:
                banned = [*s.stop_token_ids, *eos]
                rows.extend([i] * len(banned))
                ids.extend(banned)
        if not ids:
            return None
        return BannedTokens(np.array(rows, dtype=np.int64), np.array(ids, dtype=np.int64))

    def _match_stop_string(self, req: Req) -> str | None:
        """The stop string that the newest token completes, if any: of the occurrences
        that end in its text, the one that starts first (the text is cut there, so it then
        holds no stop string past ``min_new_tokens``). An occurrence that ended earlier is
        not a match now: it came before ``min_new_tokens`` allowed a stop. The text is
        decoded as the client sees it (``skip_special_tokens``), so a stop string can
        match a special token's text."""
        stops = req.sampling.stop
        # The scheduler admits no request with stop strings when there is no decoder.
        assert self._decode is not None, "stop strings without a tokenizer"
        skip = req.sampling.skip_special_tokens
        window = self._stop_window(req.output_ids, max(len(stop.encode()) for stop in stops), skip)
        text = self._decode(window, skip)
        # Past this point the text is the newest token's (an unfinished UTF-8 sequence
        # that it completes decoded to U+FFFD before it).
        settled = len(self._decode(window[:-1], skip).rstrip(_REPLACEMENT))
        best: tuple[int, str] | None = None
        for stop in stops:
            at = text.find(stop, max(0, settled - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best[1] if best is not None else None

    def _stop_window(self, ids: list[int], longest: int, skip: bool) -> list[int]:
        """The newest tokens that hold any occurrence of a stop string (at most ``longest``
        bytes) that ends in the newest token. The occurrence's other bytes lie in at most
        ``longest - 1`` tokens of text before it, and one more gives the decoder context.
        A token with no text of its own (a special token under skip_special_tokens) adds no
        byte, so the walk goes past it: counting it as a byte would cut the window short
        of the stop's start. Cost: one dict lookup per token walked past."""
        need = longest
        start = len(ids) - 1
        while start > 0 and need > 0:
            start -= 1
            if not self._is_textless(ids[start], skip):
                need -= 1
        return ids[start:]

    def _is_textless(self, token: int, skip: bool) -> bool:
        key = (token, skip)
        known = self._textless.get(key)
        if known is None:
            assert self._decode is not None
            known = self._textless[key] = self._decode([token], skip) == ""
        return known
