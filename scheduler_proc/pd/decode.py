"""Decode side of PD disaggregation: fetches each request's KV from the prefill server and
hands the scheduler requests that arrive "prebuilt". ``DecodeBootstrapper`` is the
scheduler's ``PdRole`` on a decode server.

A request with a bootstrap room and endpoint (``Req.pd``: a ``DecodeBootstrap``) never
prefills here. ``start`` sends a ``KVFetch`` (attempt 0: the prompt); ``poll`` takes the
transfers that arrived and moves their requests to ``ready``; ``take_inputs`` installs the
KV into pool slots the scheduler gives (in arrival order, while the pool allows), and the
request joins the running batch. A retraction frees the KV and calls ``start`` again (a
re-bootstrap). Nothing waits forever: a lost or refusing peer, a prefill server's error or
a malformed transfer fails a fetch with a 502, and no answer within ``timeout`` with a 504.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from pipeline.io_struct import FinishAbort, KVFetch, KVTransferHeader
from pipeline.logprob_columns import TokenLogprobs, read_input_token_logprobs, read_token_logprobs
from pipeline.sockets import RateLimitedWarning
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.pd.kv_transfer import (
    KVFetchClient,
    KVTransferError,
    pool_layout,
    scatter_kv,
    tensors_from_frames,
)
from scheduler_proc.pd.role import PdHost
from scheduler_proc.pd_state import DecodeBootstrap, Prebuilt
from scheduler_proc.req import Req

logger = logging.getLogger("tokenpipe.pd.decode")


def bootstrap_of(req: Req) -> DecodeBootstrap:
    """``req.pd`` of a request this side fetches KV for (the only kind it holds)."""
    pd = req.pd
    assert isinstance(pd, DecodeBootstrap), f"{req!r} is not a PD request of a decode server"
    return pd


def install_prebuilt(req: Req, kv: KVPool, slots: torch.Tensor, now: float) -> None:
    """Writes req's arrived KV into ``slots`` and records the bootstrap in its stats. The
    first token, when the transfer has one, is for the scheduler to append; its logprobs
    and the prompt's wait on the request for its first row."""
    pd = bootstrap_of(req)
    assert pd.prebuilt is not None
    prebuilt, pd.prebuilt = pd.prebuilt, None
    header = prebuilt.header
    scatter_kv(kv, slots, prebuilt.k, prebuilt.v)
    req.kv_slots = slots
    req.num_computed = header.num_tokens
    if prebuilt.first_logprobs is not None:
        req.pending_logprobs.append(prebuilt.first_logprobs)
    if prebuilt.prompt_logprobs is not None:
        req.prompt_logprobs.append(prebuilt.prompt_logprobs)
    req.prompt_logprobs_next = None  # a decode server never computes prompt logprobs itself
    req.leave_waiting_queue(now)
    # A re-bootstrap's new cached tokens show on the request's next row (the epoch).
    req.update_stats(
        cached_tokens=header.cached_tokens, cached_tokens_details=header.cached_tokens_details
    )
    times = {"bootstrap_done_time": prebuilt.received_time, "decode_prebuilt_finish_time": now}
    ts = req.stats.time_stats
    if ts is not None and ts.prefill_finished_time is None:
        times["prefill_finished_time"] = header.prefill_finished_time or now
    req.update_time_stats(**times)


class DecodeBootstrapper:
    def __init__(
        self,
        client: KVFetchClient,
        kv: KVPool,
        timeout: float,
        vocab_size: int,
        connect_grace: float = 3.0,
    ) -> None:
        self.client = client
        self.kv = kv
        self.vocab_size = vocab_size
        self.connect_grace = connect_grace
        self.layout = pool_layout(kv)
        self.timeout = timeout
        # (endpoint, room) -> request waiting for its KV
        self._pending: dict[tuple[str, int], Req] = {}
        # Requests whose fetch starts at the next step (steps run: not paused), so that a
        # paused server asks for no KV that weights about to be swapped out would make.
        self._to_fetch: deque[Req] = deque()
        self.ready: deque[Req] = deque()  # KV arrived, waiting for pool slots
        self._stray = RateLimitedWarning(logger)
        self._failed: list[Req] = []  # failed in start(), reported by the next poll()

    # --- the scheduler's hooks (PdRole) ----------------------------------------------------

    def bind(self, req: Req, room: int | None, endpoint: str | None) -> None:
        if room is not None and endpoint:  # else it prefills here, as on a unified server
            req.pd = DecodeBootstrap(room, endpoint)

    def on_admit(self, req: Req, now: float) -> bool:
        if not req.kv_prebuilt:
            return False
        self._to_fetch.append(req)
        return True

    def take_inputs(self, host: PdHost, rows: list[Req], now: float) -> list[Req]:
        """Takes arrived KV and installs it while the pool allows (in arrival order);
        returns the requests that join the running batch after this step's decode.
        Failed bootstraps become rows."""
        while self._to_fetch:
            self.start(self._to_fetch.popleft(), now)
        rows.extend(self.poll(now))
        joined: list[Req] = []
        while self.ready:
            req = self.ready[0]
            prebuilt = bootstrap_of(req).prebuilt
            assert prebuilt is not None
            header = prebuilt.header
            slots = host.slots_for_joining(header.num_tokens, len(joined))
            if slots is None:
                break
            self.ready.popleft()
            install_prebuilt(req, self.kv, slots, time.time())
            if req.output_ids:  # re-bootstrapped: its last token is the next decode step's input
                joined.append(req)
            else:  # the prefill server's first token is this request's first output
                assert header.first_token is not None  # checked on arrival (_prebuilt)
                joined.extend(host.append_tokens([req], [header.first_token], rows))
        return joined

    def on_first_token(self, reqs: list[Req]) -> None:
        pass  # a request prefilled here is not a PD request

    def on_retract(self, req: Req, now: float) -> bool:
        """A PD request's KV is fetched again (a re-bootstrap) instead of re-prefilled: the
        prefill server recomputes the prompt plus the generated tokens, mostly from its
        prefix cache, and reports its new cached tokens."""
        if not req.kv_prebuilt:
            return False
        self._to_fetch.append(req)
        # A warning: retraction means the pool is too small for the load, and tests and
        # operators count these lines.
        logger.warning(
            "retracted req_id=%d rid=%s retraction_count=%d: re-bootstrapping its KV from %s",
            req.req_id, req.rid, req.retraction_count, bootstrap_of(req).endpoint,
        )  # fmt: skip
        return True

    def on_abort(self, req: Req) -> None:
        self.discard(req)

    def on_release(self, req: Req, now: float) -> None:
        pass  # the KV came from the prefill server: nothing goes back

    def refetch(self) -> None:
        """Fetches again, once steps run, what is being fetched or arrived uninstalled (a
        new attempt: a transfer of the old one arriving later is dropped)."""
        waiting = [*self._pending.values(), *self.ready]
        self._pending.clear()
        self.ready.clear()
        for req in waiting:
            bootstrap_of(req).prebuilt = None
        self._to_fetch.extend(waiting)

    # --- fetching KV ---------------------------------------------------------------------

    def start(self, req: Req, now: float) -> None:
        """Fetches the KV of everything req holds but its last token (that one is the next
        decode step's input): the prompt at first, the prompt plus output after a retraction."""
        pd = bootstrap_of(req)
        # Connection events from before this fetch are about earlier fetches, not this one.
        self._fail_lost_peers(now)
        other = self._pending.get((pd.endpoint, pd.room))
        if other is not None and other is not req:
            # Its transfer could not be told from the other's: refuse rather than mix them up.
            req.finish(
                FinishAbort(
                    message=f"bootstrap room {pd.room} is already in use by another request",
                    status_code=400,
                ),
                now,
            )
            self._failed.append(req)
            return
        pd.attempt += 1
        pd.deadline = now + self.timeout
        pd.sent_time = now
        pd.prebuilt = None
        token_ids = req.fill_ids[:-1] if req.output_ids else req.origin_input_ids
        fetch = KVFetch(
            room=pd.room,
            attempt=pd.attempt,
            token_ids=token_ids,
            prompt_tokens=len(req.origin_input_ids),
            layout=self.layout,
            lora=None if req.lora is None else req.lora.name,
        )
        try:
            self.client.send(pd.endpoint, fetch)
        except KVTransferError as exc:
            req.finish(
                FinishAbort(
                    message=f"PD bootstrap of room {pd.room} failed: {exc}", status_code=502
                ),
                now,
            )
            self._failed.append(req)
            return
        self._pending[(pd.endpoint, pd.room)] = req

    def poll(self, now: float) -> list[Req]:
        """Takes arrived transfers; returns the requests that failed (finished, with the
        reason), for the scheduler to emit and release. A fetch with no answer within
        ``timeout`` seconds (the prefill server never got the request, or hangs) fails with
        a 504."""
        failed: list[Req] = []
        for endpoint, header, frames in self.client.receive():
            req = self._pending.get((endpoint, header.room))
            pd = req.pd if req is not None else None
            if req is None or not isinstance(pd, DecodeBootstrap) or pd.attempt != header.attempt:
                self._stray.warn(
                    "dropped a KV transfer for room %d (attempt %d) from %s: "
                    "no request waits for it",
                    header.room,
                    header.attempt,
                    endpoint,
                )
                continue
            del self._pending[(endpoint, header.room)]
            try:
                pd.prebuilt = self._prebuilt(header, frames, req, now)
            except KVTransferError as exc:
                req.finish(
                    FinishAbort(
                        message=f"PD bootstrap of room {pd.room} from {endpoint} failed: {exc}",
                        status_code=502,
                    ),
                    now,
                )
                failed.append(req)
                continue
            self.ready.append(req)
        self._fail_lost_peers(now)
        failed += self._failed  # failed in start() or by a lost peer
        self._failed = []
        for key, req in list(self._pending.items()):
            pd = bootstrap_of(req)
            if now > pd.deadline:
                del self._pending[key]
                message = (
                    f"PD bootstrap timed out after {self.timeout:g} s: the prefill server at "
                    f"{pd.endpoint} sent no KV for room {pd.room} (is it running, and did it "
                    "get this request?)"
                )
                req.finish(FinishAbort(message=message, status_code=504), now)
                failed.append(req)
        for req in failed:
            reason = req.finished_reason
            assert isinstance(reason, FinishAbort)
            logger.warning("req_id=%d rid=%s failed: %s", req.req_id, req.rid, reason.message)
        return failed

    def _fail_lost_peers(self, now: float) -> None:
        """Fails the fetches out to a peer that dropped the connection, or that has refused
        connections for ``connect_grace`` seconds of the fetch's life (the grace lets a
        restarting peer come back, and connection events that raced the fetch settle)."""
        lost = self.client.lost_peers(now)
        for key, req in list(self._pending.items()):
            pd = bootstrap_of(req)
            down = self.client.down_since(pd.endpoint)
            if pd.endpoint in lost:
                why = f"the connection to the prefill server at {pd.endpoint} was lost"
            elif down is not None and now - max(down, pd.sent_time) >= self.connect_grace:
                why = f"cannot connect to the prefill server at {pd.endpoint} (is it running?)"
            else:
                continue
            del self._pending[key]
            req.finish(
                FinishAbort(
                    message=f"PD bootstrap of room {pd.room} failed: {why}", status_code=502
                ),
                now,
            )
            self._failed.append(req)

    def _prebuilt(
        self, header: KVTransferHeader, frames: list[bytes], req: Req, now: float
    ) -> Prebuilt:
        """The arrived KV of the tokens req asked for: all it holds but its last token."""
        asked = req.seq_len - 1 if req.output_ids else len(req.origin_input_ids)
        prompt = len(req.origin_input_ids)
        if not header.ok:
            raise KVTransferError(header.error or "the prefill server refused without a reason")
        if len(frames) != 2:
            raise KVTransferError(
                f"a transfer has a header and 2 tensor frames, got {len(frames)} after the header"
            )
        if header.num_tokens != asked:
            raise KVTransferError(f"asked for the KV of {asked} tokens, got {header.num_tokens}")
        if not req.output_ids and not (
            header.first_token is not None and 0 <= header.first_token < self.vocab_size
        ):
            raise KVTransferError(
                "the first transfer must carry a first token in "
                f"[0, {self.vocab_size}), got {header.first_token}"
            )
        if not 0 <= header.cached_tokens <= prompt:
            raise KVTransferError(
                f"cached_tokens {header.cached_tokens} is outside [0, {prompt}], the prompt"
            )
        first, prompt_lp = self._logprobs(header, req)
        k, v = tensors_from_frames(header, frames[0], frames[1], self.layout)
        return Prebuilt(header, k, v, now, first, prompt_lp)

    def _logprobs(
        self, header: KVTransferHeader, req: Req
    ) -> tuple[TokenLogprobs | None, TokenLogprobs | None]:
        """The first token's and the prompt's logprobs a first transfer carries for a
        request that asked (the prefill server computed them: nothing is computed twice, and
        the request's first row carries them), checked as the tokenizer manager checks a
        frame's, and against what this request asked: one token, then the prompt positions
        it still needs (``prompt_logprobs_next`` on), each with its top_logprobs_num and
        token ids. A re-bootstrap's transfer carries none, as none are sent twice."""
        lp = header.logprobs
        if req.output_ids:
            if lp is not None:
                raise KVTransferError(
                    "a re-bootstrap carries no logprobs: the first transfer sent them"
                )
            return None, None
        ask = req.logprob
        if ask is None:
            return None, None  # the prefill side's request asked, this one did not: answer as asked
        if lp is None or lp.output is None:
            raise KVTransferError(
                "the request asks for logprobs and the transfer carries none for its first "
                "token (did the prefill server's request ask too?)"
            )
        nxt = req.prompt_logprobs_next
        want_prompt = 0 if nxt is None else len(req.origin_input_ids) - 1 - nxt
        try:
            first = read_token_logprobs(lp.output, [1]).get(0)
            prompt = read_input_token_logprobs(lp.input, 1).get(0) if lp.input is not None else None
        except ValueError as exc:
            raise KVTransferError(f"malformed logprobs: {exc}") from None
        got_prompt = 0 if prompt is None else len(prompt.chosen)
        if first is None or got_prompt != want_prompt:
            got_first = 0 if first is None else 1
            raise KVTransferError(
                f"asked for the logprobs of 1 first token and {want_prompt} prompt positions, "
                f"got {got_first} and {got_prompt}"
            )
        k, m = ask.top_logprobs_num, len(ask.token_ids_logprob)
        for part in (first, prompt) if prompt is not None else (first,):
            if part.top_ids.shape[1] != k or part.ids_values.shape[1] != m:
                got_k, got_m = part.top_ids.shape[1], part.ids_values.shape[1]
                raise KVTransferError(
                    f"asked for {k} top logprobs and {m} token ids per position, "
                    f"got {got_k} and {got_m}"
                )
            if part.top_ids.size and not (
                0 <= part.top_ids.min() and part.top_ids.max() < self.vocab_size
            ):
                raise KVTransferError(
                    f"a top logprob names a token id outside [0, {self.vocab_size})"
                )
        return first, prompt if got_prompt else None

    def discard(self, req: Req) -> None:
        """Forgets an aborted request wherever it is (a transfer arriving later is dropped)."""
        pd = req.pd
        if isinstance(pd, DecodeBootstrap):
            if self._pending.get((pd.endpoint, pd.room)) is req:
                del self._pending[(pd.endpoint, pd.room)]
            pd.prebuilt = None
        if req in self.ready:
            self.ready.remove(req)
        if req in self._to_fetch:
            self._to_fetch.remove(req)

    @property
    def has_work(self) -> bool:
        """Something the next step must handle: a fetch to start, KV to install, or a
        failure to report."""
        return bool(self._to_fetch or self.ready or self._failed)

    @property
    def num_waiting(self) -> int:
        return len(self._to_fetch) + len(self._pending) + len(self.ready)
