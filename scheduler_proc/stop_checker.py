"""Decides whether a request is finished after a token was appended: max_new_tokens,
EOS (unless ignore_eos), stop token ids and stop strings (SPEC section 4)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipeline.io_struct import FinishLength, FinishReason, FinishStop
from scheduler_proc.req import Req


class StopChecker:
    def __init__(self, eos_token_ids: frozenset[int], decode: Callable[[Sequence[int]], str], context_length: int) -> None:
        self._eos = eos_token_ids
        self._decode = decode
        self._context_length = context_length

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

    def _match_stop_string(self, req: Req) -> str | None:
        # A stop string that completed now ends inside the newest token, and every token
        # is at least one byte, so the last len(stop in bytes) tokens cover it.
        longest = max(len(stop.encode()) for stop in req.sampling.stop)
        tail = self._decode(req.output_ids[-(longest + 1) :])
        for stop in req.sampling.stop:
            if stop in tail:
                return stop
        return None
