"""Random request lifecycles for the differential test (SPEC section 9).

Each lifecycle is a generator that changes one ``Req`` exactly the way the scheduler's
code paths do (the same ``Req`` methods: queue entry and exit, the one stats setter,
retraction, finish) and queues its row when ``Req.output_due()`` says so; each ``yield``
ends a scheduler step. The model is not involved: tokens are drawn at random.

Covered: prefill with a cached prefix, chunked prefill (steps without rows), decode with
stream intervals 1 to 3, retraction at random steps and re-prefill, PD-decode prebuilt
requests with re-bootstrap (new cached tokens and bootstrap times), dLLM blocks (several
tokens per row, cached tokens changing with each block), HiCache storage attach/detach
while requests run, storage prefetch waits, aborts, finishes by length, stop token and
stop string, and embedding requests (one finished row each, through
``build_embedding_output``).
"""

from __future__ import annotations

import random
from collections.abc import Generator
from dataclasses import dataclass, field

from pipeline.io_struct import (
    CachedTokensDetails,
    FinishAbort,
    FinishLength,
    FinishStop,
    MediaItem,
    SamplingParams,
)
from scheduler_proc.hicache import cached_details
from scheduler_proc.req import Req

Step = Generator[None, None, None]
STOP_STRINGS = ("END", "\n\n")


@dataclass
class SimWorld:
    """What the lifecycles share: the clock, this step's rows, and HiCache storage."""

    rng: random.Random
    now: float = 1_000_000.0
    rows: list[Req] = field(default_factory=list)
    embedding_rows: list[Req] = field(default_factory=list)
    storage_backend: str | None = None
    live: set[Req] = field(default_factory=set)

    def emit_if_due(self, req: Req) -> None:
        if req.output_due() and req not in self.rows:
            self.rows.append(req)

    def set_cached(self, req: Req, device: int, host: int = 0, storage: int = 0) -> None:
        """Cached tokens per tier, as the scheduler records them (``Req.cached_by_tier``)."""
        req.cached_by_tier = (device, host, storage)
        cached, details = device + host + storage, self.details(device, host, storage)
        if (cached, details) != (req.stats.cached_tokens, req.stats.cached_tokens_details):
            req.update_stats(cached_tokens=cached, cached_tokens_details=details)

    def details(self, device: int, host: int, storage: int) -> CachedTokensDetails | None:
        """Cached-token details as the cache would report them right now."""
        return cached_details(device, host, storage, self.storage_backend)

    def toggle_storage(self) -> None:
        """Attach or detach HiCache storage: every running request's details change keys,
        through the one setter, as the real attach/detach does (``Scheduler.storage_control``)."""
        self.storage_backend = None if self.storage_backend else self.rng.choice(["file", "mooncake"])
        for req in self.live:
            details = self.details(*req.cached_by_tier)
            if details != req.stats.cached_tokens_details:
                req.update_stats(cached_tokens_details=details)


def make_sampling(rng: random.Random, stream: bool) -> tuple[SamplingParams, int]:
    max_new = rng.randint(1, 40)
    sampling = SamplingParams(
        max_new_tokens=max_new,
        stream_interval=rng.choice([None, 1, 2, 3]),
        skip_special_tokens=rng.random() < 0.8,
        stop=STOP_STRINGS if rng.random() < 0.3 else (),
        no_stop_trim=rng.random() < 0.2,
    )
    return sampling, max_new


def make_req(
    rng: random.Random, req_id: int, sampling: SamplingParams, stream: bool, metrics: bool, now: float, embedding: bool = False
) -> Req:
    media = []
    if rng.random() < 0.2:
        for kind in ("image", "audio", "video"):
            if rng.random() < 0.5:
                media.append(MediaItem(kind=kind, num_tokens=rng.randint(1, 64)))  # type: ignore[arg-type]
    prompt_len = rng.randint(1, 300) + sum(m.num_tokens for m in media)
    return Req(
        rid=f"sim-{req_id}",
        req_id=req_id,
        input_ids=[rng.randint(6, 4095) for _ in range(prompt_len)],
        sampling=sampling,
        stream=stream,
        stream_interval=rng.randint(1, 3),
        arrival_time=now,
        media=tuple(media),
        collect_time_stats=metrics,
        is_embedding=embedding,
    )


def lifecycle(world: SimWorld, req: Req, stop_token: int) -> Step:
    rng = world.rng
    kind = rng.choices(["unified", "pd_decode", "dllm"], weights=[6, 2, 2])[0]
    block = rng.randint(2, 4) if kind == "dllm" else 1
    world.live.add(req)
    req.enter_waiting_queue(world.now)
    for _ in range(rng.randint(0, 2)):
        yield
    yield from admit(world, req, kind, first=True)
    while True:
        roll = rng.random()
        if roll < 0.04:
            req.finish(FinishAbort(message="aborted by client", status_code=499), world.now)
        elif roll < 0.10 and len(req.output_ids) > 0:
            req.mark_retracted(world.now)
            for _ in range(rng.randint(1, 3)):
                yield
            yield from admit(world, req, kind, first=False)
        elif roll < 0.13:
            ts = req.stats.time_stats
            if ts is not None:
                req.update_time_stats(storage_prefetch_wait=ts.storage_prefetch_wait + rng.random() / 100)
        if not req.finished:
            for _ in range(block):
                if append_token(world, req, stop_token):
                    break
            if kind == "dllm" and not req.finished:
                # A committed block extends what the cache holds for this request.
                world.set_cached(req, req.stats.cached_tokens + block)
        world.emit_if_due(req)
        if req.finished:
            world.live.discard(req)
            return
        yield


def embedding_lifecycle(world: SimWorld, req: Req) -> Step:
    """An embedding request: queue, prefill in chunks, then one finished row with stats."""
    req.enter_waiting_queue(world.now)
    for _ in range(world.rng.randint(0, 2)):
        yield
    req.leave_waiting_queue(world.now)
    for _ in range(world.rng.randint(0, 3)):
        yield
    req.update_time_stats(prefill_finished_time=world.now)
    if world.rng.random() < 0.05:
        req.finish(FinishAbort(message="aborted by client", status_code=499), world.now)
    else:
        req.finish(FinishLength(length=0), world.now)
    world.embedding_rows.append(req)


def admit(world: SimWorld, req: Req, kind: str, *, first: bool) -> Step:
    """Queue exit, (re-)prefill in chunks without rows, then the step that emits."""
    rng = world.rng
    req.leave_waiting_queue(world.now)
    if kind == "pd_decode":
        # Prebuilt: the KV arrives from the prefill server, which reports its cached tokens.
        world.set_cached(req, rng.randint(0, len(req.origin_input_ids) - 1))
        req.update_time_stats(bootstrap_done_time=world.now, decode_prebuilt_finish_time=world.now + 0.001)
    elif first:
        device = rng.randint(0, len(req.origin_input_ids) - 1) if rng.random() < 0.5 else 0
        host = rng.randint(0, 8) if device and rng.random() < 0.3 else 0
        storage = rng.randint(0, 8) if device and world.storage_backend and rng.random() < 0.3 else 0
        if storage:  # read from storage files before the prefill
            ts = req.stats.time_stats
            if ts is not None:
                req.update_time_stats(storage_prefetch_wait=ts.storage_prefetch_wait + rng.random() / 100)
        world.set_cached(req, device, host, storage)
    for _ in range(rng.randint(0, 3)):  # chunked prefill: no row until the last chunk
        yield
    ts = req.stats.time_stats
    if ts is not None and ts.prefill_finished_time is None:
        req.update_time_stats(prefill_finished_time=world.now)


def append_token(world: SimWorld, req: Req, stop_token: int) -> bool:
    """One generated token and the stop checks; True when the request finished."""
    rng = world.rng
    s = req.sampling
    token = stop_token if rng.random() < 0.03 else rng.randint(6, 4095)
    req.output_ids.append(token)
    if token == stop_token and not s.ignore_eos:
        req.finish(FinishStop(matched=token), world.now)
    elif s.stop and rng.random() < 0.05:
        req.finish(FinishStop(matched=rng.choice(s.stop)), world.now)
    elif len(req.output_ids) >= s.max_new_tokens:
        req.finish(FinishLength(length=s.max_new_tokens), world.now)
    return req.finished
