"""Prefill side of PD disaggregation: hands each request's KV to the decode server that
fetches it. ``PrefillKVSender`` is the scheduler's ``PdRole`` on a prefill server.

Two kinds of requests carry a ``Req.pd`` here (scheduler_proc/pd_state.py):
- ``PrefillHalf``: a request this server's API received with a bootstrap room. It runs as
  usual (its API clamps it to one new token). When it is released, its prompt KV, first
  token and (when asked) logprobs go to the decode server's fetch for the same room: at
  once if the fetch has arrived, else kept until it does (at most ``timeout`` seconds).
- ``KVFetchJob``: a re-bootstrap. A decode server retracted the request and asks again for
  the prompt plus the tokens it generated; the scheduler computes that KV as an internal
  prefill that emits no rows (mostly from the prefix cache), and its release sends the KV.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pipeline.io_struct import (
    CachedTokensDetails,
    FinishAbort,
    FrameLogprobs,
    KVFetch,
    KVTransferHeader,
    SamplingParams,
)
from pipeline.logprob_columns import TokenLogprobs, build_input_logprobs, build_output_logprobs
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.pd.kv_transfer import KVFetchServer, gather_kv, pool_layout
from scheduler_proc.pd.role import PdHost
from scheduler_proc.pd_state import KVFetchJob, PrefillHalf
from scheduler_proc.req import Req, StatsPending

logger = logging.getLogger("tokenpipe.pd.prefill")


def keep_first_logprobs(req: Req) -> None:
    """Called once a prefill half's first token is sampled: puts its logprobs into one-row
    columns for the KV header. The first token's are copied (its own row still lists them:
    ``Req.take_pending_logprobs`` hands them over then); the prompt's are taken, so only the
    decode server's answer lists them (sglang-router joins the prefill answer's
    ``input_token_logprobs`` to the decode answer's: see ``RequestChecks.answered_logprobs``
    in tokenizer_proc/request_checks.py). No-op for a request that did not ask."""
    pd = req.pd
    if not isinstance(pd, PrefillHalf) or req.logprob is None or not req.pending_logprobs:
        return
    assert req.prompt_logprobs_next is None, (
        "a prefill half samples its first token after its whole prompt"
    )
    prompt = req.take_prompt_logprobs()
    pd.logprobs = FrameLogprobs(
        output=build_output_logprobs([0], [TokenLogprobs.join(req.pending_logprobs)]),
        input=build_input_logprobs([0], [prompt]) if prompt is not None else None,
    )


# A re-bootstrap generates nothing: it ends when its tokens' KV is computed.
_KV_ONLY = SamplingParams(max_new_tokens=0)


def kv_job_request(
    identity: bytes,
    fetch: KVFetch,
    req_id: int,
    now: float,
    collect_time_stats: bool,
    stats_pending: StatsPending,
) -> Req:
    """The internal request that computes a re-bootstrap's KV; it emits no row."""
    req = Req(
        rid=f"kv-fetch-{fetch.room}-{fetch.attempt}",
        req_id=req_id,
        input_ids=fetch.token_ids,
        sampling=_KV_ONLY,
        stream=False,
        stream_interval=1,
        arrival_time=now,
        stats_pending=stats_pending,
        collect_time_stats=collect_time_stats,
    )
    req.pd = KVFetchJob(identity, fetch)
    return req


@dataclass
class _Stashed:
    header: KVTransferHeader
    k: torch.Tensor | None
    v: torch.Tensor | None
    deadline: float

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None or self.v is None else self.k.nbytes + self.v.nbytes


# Host memory that KV nobody has fetched yet may take: a decode server that never fetches
# (down, or refusing the requests) must not make the prefill server grow without bound.
STASH_LIMIT_BYTES = 1 << 30


@dataclass
class _WaitingFetch:
    identity: bytes
    deadline: float


class PrefillKVSender:
    def __init__(
        self,
        server: KVFetchServer,
        kv: KVPool,
        timeout: float,
        stash_limit_bytes: int = STASH_LIMIT_BYTES,
    ) -> None:
        self.server = server
        self.stash_limit_bytes = stash_limit_bytes
        self._stash_bytes = 0
        self.kv = kv
        self.layout = pool_layout(kv)
        self.timeout = timeout
        # room -> a first fetch that came before its prefill ended
        self._waiting: dict[int, _WaitingFetch] = {}
        # room -> KV of a finished prefill that nobody fetched yet
        self._stash: dict[int, _Stashed] = {}
        self._next_job_id = -1  # re-bootstrap requests count down: never a client's req_id

    # --- the scheduler's hooks (PdRole) ----------------------------------------------------

    def bind(self, req: Req, room: int | None, endpoint: str | None) -> None:
        if room is not None:
            req.pd = PrefillHalf(room)

    def on_admit(self, req: Req, now: float) -> bool:
        return False  # every request prefills here

    def take_inputs(self, host: PdHost, rows: list[Req], now: float) -> list[Req]:
        """Takes the decode servers' fetches. A re-bootstrap becomes an internal request
        that computes the KV of ``fetch.token_ids`` (from the prefix cache where it can)
        and emits no row; nothing joins the running batch directly."""
        for identity, fetch in self.receive(now):
            req = kv_job_request(
                identity, fetch, self._next_job_id, now, host.collect_time_stats, host.stats_pending
            )
            self._next_job_id -= 1
            problem = host.loras.bind_named(req, fetch.lora) or (
                host.admission.problem(req) if fetch.token_ids else "the fetch names no tokens"
            )
            if problem is not None:
                self.refuse(identity, fetch, problem)
            else:
                host.enqueue(req, now)
        return []

    def on_first_token(self, reqs: list[Req]) -> None:
        for req in reqs:
            keep_first_logprobs(req)  # for the KV header, before its own row takes them

    def on_retract(self, req: Req, now: float) -> bool:
        return False  # re-prefilled here, as on a unified server

    def on_abort(self, req: Req) -> None:
        pass  # its release answers the decode server

    def refetch(self) -> None:
        pass  # its KV jobs were retracted like any request: recomputed after the continue

    @property
    def has_work(self) -> bool:
        return False  # fetches wake the scheduler's poller and are taken at each step

    @property
    def num_waiting(self) -> int:
        return 0

    # --- the KV fetch endpoint ---------------------------------------------------------------

    def receive(self, now: float) -> list[tuple[bytes, KVFetch]]:
        """Takes the fetches that arrived: a first fetch is paired with its room here; the
        re-bootstraps are returned for the scheduler to compute."""
        jobs: list[tuple[bytes, KVFetch]] = []
        for identity, fetch in self.server.receive():
            if fetch.layout != self.layout:
                message = (
                    f"this prefill server's KV layout {self.layout} differs from the decode "
                    f"server's {fetch.layout} (different models?)"
                )
                self.server.send(
                    identity,
                    KVTransferHeader(
                        room=fetch.room, attempt=fetch.attempt, ok=False, error=message
                    ),
                )
            elif fetch.attempt > 0:
                jobs.append((identity, fetch))
            else:
                stashed = self._unstash(fetch.room)
                if stashed is not None:
                    self.server.send(identity, stashed.header, stashed.k, stashed.v)
                else:
                    self._waiting[fetch.room] = _WaitingFetch(identity, now + self.timeout)
        self._expire(now)
        return jobs

    def refuse(self, identity: bytes, fetch: KVFetch, message: str) -> None:
        self.server.send(
            identity,
            KVTransferHeader(room=fetch.room, attempt=fetch.attempt, ok=False, error=message),
        )

    def on_release(self, req: Req, now: float) -> None:
        """Called just before a request's KV is released: a PD request's is packaged and
        sent or kept."""
        pd = req.pd
        if pd is None:
            return
        if isinstance(pd, KVFetchJob):
            # A re-bootstrap's header carries no logprobs: the first transfer sent them.
            header, k, v = self._package(
                req,
                pd.fetch.room,
                pd.fetch.attempt,
                len(pd.fetch.token_ids),
                pd.fetch.prompt_tokens,
            )
            self.server.send(pd.identity, header, k, v)
            return
        assert isinstance(pd, PrefillHalf)
        header, k, v = self._package(
            req, pd.room, 0, len(req.origin_input_ids), len(req.origin_input_ids), pd.logprobs
        )
        waiting = self._waiting.pop(pd.room, None)
        if waiting is not None:
            self.server.send(waiting.identity, header, k, v)
        else:
            self._keep(pd.room, _Stashed(header, k, v, now + self.timeout))

    def _keep(self, room: int, stashed: _Stashed) -> None:
        """Stashes until fetched; over the byte limit the oldest go first (dicts keep order)."""
        self._unstash(room)
        self._stash[room] = stashed
        self._stash_bytes += stashed.nbytes
        while self._stash_bytes > self.stash_limit_bytes and len(self._stash) > 1:
            oldest = next(iter(self._stash))
            self._unstash(oldest)
            logger.warning(
                "dropped the unfetched KV of bootstrap room %d: unfetched KV is over %d bytes",
                oldest,
                self.stash_limit_bytes,
            )

    def _unstash(self, room: int) -> _Stashed | None:
        stashed = self._stash.pop(room, None)
        if stashed is not None:
            self._stash_bytes -= stashed.nbytes
        return stashed

    def _package(
        self,
        req: Req,
        room: int,
        attempt: int,
        num_tokens: int,
        prompt_tokens: int,
        logprobs: FrameLogprobs | None = None,
    ) -> tuple[KVTransferHeader, torch.Tensor | None, torch.Tensor | None]:
        reason = req.finished_reason
        if req.kv_slots is None or req.num_computed < num_tokens:
            why = (
                reason.message
                if isinstance(reason, FinishAbort)
                else "its prefill did not complete"
            )
            return (
                KVTransferHeader(
                    room=room,
                    attempt=attempt,
                    ok=False,
                    error=f"the prefill server dropped the request: {why}",
                ),
                None,
                None,
            )
        k, v = gather_kv(self.kv, req.kv_slots[:num_tokens])
        stats = req.stats
        cached = min(stats.cached_tokens, prompt_tokens)
        header = KVTransferHeader(
            room=room,
            attempt=attempt,
            ok=True,
            num_tokens=num_tokens,
            layout=self.layout,
            first_token=req.output_ids[0] if attempt == 0 and req.output_ids else None,
            cached_tokens=cached,
            cached_tokens_details=_capped(
                stats.cached_tokens_details, stats.cached_tokens - cached
            ),
            prefill_finished_time=stats.time_stats.prefill_finished_time
            if stats.time_stats is not None
            else None,
            logprobs=logprobs,
        )
        return header, k, v

    def _expire(self, now: float) -> None:
        for room in [room for room, s in self._stash.items() if s.deadline < now]:
            self._unstash(room)
            logger.warning(
                "dropped the KV of bootstrap room %d: no decode server fetched it within %g s",
                room,
                self.timeout,
            )
        for room in [room for room, w in self._waiting.items() if w.deadline < now]:
            waiting = self._waiting.pop(room)
            message = (
                f"the prefill server got no request for bootstrap room {room} "
                f"within {self.timeout:g} s"
            )
            self.server.send(
                waiting.identity, KVTransferHeader(room=room, attempt=0, ok=False, error=message)
            )

    @property
    def num_held(self) -> int:
        return len(self._stash) + len(self._waiting)


def _capped(details: CachedTokensDetails | None, excess: int) -> CachedTokensDetails | None:
    """Cached-token details without the hits beyond the prompt (a re-bootstrap may also
    hit generated tokens, which are not prompt tokens). The deepest tier goes first: a
    match runs device, then host, then storage."""
    if details is None or excess <= 0:
        return details
    storage = details.storage or 0
    cut_storage = min(storage, excess)
    cut_host = min(details.host, excess - cut_storage)
    cut_device = excess - cut_storage - cut_host
    return CachedTokensDetails(
        device=details.device - cut_device,
        host=details.host - cut_host,
        storage=None if details.storage is None else storage - cut_storage,
        storage_backend=details.storage_backend,
    )
