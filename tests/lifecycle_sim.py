"""Random request lifecycles for the differential test (docs/design.md section 9).

Each lifecycle is a generator that changes one ``Req`` exactly the way the scheduler's
code paths do (the same ``Req`` methods: queue entry and exit, the one stats setter,
retraction, finish) and queues its row when ``Req.output_due()`` says so; each ``yield``
ends a scheduler step. The model is not involved: tokens are drawn at random.

Covered: prefill with a cached prefix, chunked prefill (steps without rows), decode with
stream intervals 1 to 3, retraction at random steps and re-prefill, PD-decode prebuilt
requests with re-bootstrap (new cached tokens and bootstrap times), dLLM blocks (several
tokens per row, cached tokens changing with each block), HiCache storage attach/detach
while requests run, storage prefetch waits, aborts (before admission, while queued after a
retraction, and while running: their rows carry no tokens, beside multi-token rows),
finishes by length, stop token and stop strings (decided by the real ``StopChecker``, with
``min_new_tokens`` and several stop strings, over tokens drawn so that stop strings do
occur, often with special tokens inside them, which have no text when skipped), and
embedding requests (one finished row each, through ``build_embedding_output``).

Tokens are drawn as the sampler would: never one that ``StopChecker.min_new_bans_of`` bans
(EOS and the request's stop ids while it is short of ``min_new_tokens``), and some
requests are under EOS pressure (most draws would be EOS or a stop id), so they stop right
where the minimum allows.

Logprobs (``tests.sim_logprobs``): a share of unified requests ask for them (PD-decode and
dLLM requests cannot: the server refuses them). Each generated token's logprobs go to
``Req.pending_logprobs`` as the scheduler's sampling step puts them there, and each prefill
chunk computes the prompt positions not computed before (``Req.prompt_logprobs_next``), so
a re-prefill after a retraction (a running request's, or one retracted mid-prefill, as the
scheduler retracts prefilling requests first) adds nothing.

The world also keeps what the client must see, worked out without the pipeline's code:
each request's true tokens (``Req.output_ids``) and its time in the waiting queue, summed
from the clock at each entry and exit (``SimWorld.queue_time``), and which requests had their
prompt computed up to its last token (``SimWorld.prompt_computed``: their prompt logprobs are
all computed, even when a retraction or an abort came before the prefill's end).
``expected_text`` gives the text a finished request must show.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Generator
from dataclasses import dataclass, field

from pipeline.io_struct import (
    CachedTokensDetails,
    FinishAbort,
    FinishLength,
    FinishReason,
    FinishStop,
    LogprobParams,
    MediaItem,
    SamplingParams,
)
from pipeline.tokenizer_loader import LoadedTokenizer
from scheduler_proc.cache.hicache import cached_details
from scheduler_proc.req import Req, StatsPending
from scheduler_proc.stop_checker import StopChecker
from tests.sim_logprobs import OUTPUT, prefill_chunk, token_logprobs

Step = Generator[None, None, None]
Admission = Generator[None, None, bool]  # a Step that says whether the request got through
# Sets of stop strings a request may carry; several per request, some that one token can
# complete together (" sources" completes both "es" and "sou").
STOP_STRING_SETS = (("END", "\n\n"), ("es", "sou"), ("15",), ("sou", "es", " 15"))
# Text whose tokens the lifecycles draw often, so that the stop strings above do occur.
STOP_TEXT = " END of the sources\n\nes sou 15 wanting sources 15"
TOKEN_POOL = range(6, 4096)  # the ids random tokens are drawn from
SPECIAL_TOKENS = range(1, 6)  # <|im_start|> ... <|video|>: no text under skip_special_tokens
EOS_PRESSURE = 0.5  # share of the draws that would be a stop token, for a request under pressure


@dataclass
class SimWorld:
    """What the lifecycles share: the clock, this step's rows, HiCache storage, the stop
    checker and token pool, and the expected queue times."""

    rng: random.Random
    tokenizer: LoadedTokenizer
    now: float = 1_000_000.0
    rows: list[Req] = field(default_factory=list)
    embedding_rows: list[Req] = field(default_factory=list)
    storage_backend: str | None = None
    live: set[Req] = field(default_factory=set)
    queue_time: dict[int, float] = field(default_factory=dict)  # req_id -> expected queue_time
    _queue_entry: dict[int, float] = field(default_factory=dict)  # req_id -> open stay's entry
    prompt_computed: set[int] = field(
        default_factory=set
    )  # req_ids prefilled up to the prompt's last token
    stats_pending: StatsPending = field(
        default_factory=StatsPending
    )  # as a scheduler's: its requests only

    def __post_init__(self) -> None:
        self.stop_checker = StopChecker(
            self.tokenizer.eos_token_ids, self.tokenizer.decode, context_length=1 << 20
        )
        self.stop_pieces = self.tokenizer.encode(STOP_TEXT)
        self.planned: dict[int, list[int]] = {}  # req_id -> the next tokens it draws
        self._tokens_of: dict[str, list[int]] = {}
        self.vocab_size = self.tokenizer.vocab_size

    def tokens_of(self, text: str) -> list[int]:
        if text not in self._tokens_of:
            self._tokens_of[text] = self.tokenizer.encode(text)
        return self._tokens_of[text]

    def enter_queue(self, req: Req) -> None:
        req.enter_waiting_queue(self.now)
        self._queue_entry[req.req_id] = self.now
        self.queue_time.setdefault(req.req_id, 0.0)

    def retract(self, req: Req) -> None:
        req.mark_retracted(self.now)  # back into the waiting queue
        self._queue_entry[req.req_id] = self.now

    def leave_queue(self, req: Req) -> None:
        req.leave_waiting_queue(self.now)
        self._close_stay(req)

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finish(reason, self.now)
        self.planned.pop(req.req_id, None)
        self._close_stay(req)  # an abort while waiting ends the stay there

    def _close_stay(self, req: Req) -> None:
        entered = self._queue_entry.pop(req.req_id, None)
        if entered is not None:
            self.queue_time[req.req_id] += self.now - entered

    def prefill(self, req: Req, lo: int, hi: int) -> None:
        """One prefill chunk: tokens [lo, hi) of ``req.fill_ids``."""
        prefill_chunk(req, lo, hi, self.vocab_size)
        if hi >= len(req.origin_input_ids) - 1:
            self.prompt_computed.add(req.req_id)

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
        self.storage_backend = (
            None if self.storage_backend else self.rng.choice(["file", "mooncake"])
        )
        for req in self.live:
            details = self.details(*req.cached_by_tier)
            if details != req.stats.cached_tokens_details:
                req.update_stats(cached_tokens_details=details)


def make_sampling(rng: random.Random, stream: bool) -> tuple[SamplingParams, int]:
    max_new = rng.randint(1, 40)
    sampling = SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=rng.choice([0, 0, 1, 3, 5]),
        stream_interval=rng.choice([None, 1, 2, 3]),
        skip_special_tokens=rng.random() < 0.8,
        stop=rng.choice(STOP_STRING_SETS) if rng.random() < 0.4 else (),
        no_stop_trim=rng.random() < 0.2,
        stop_token_ids=(rng.choice(TOKEN_POOL),) if rng.random() < 0.2 else (),
    )
    return sampling, max_new


def pick_kind(rng: random.Random) -> str:
    """How a generation request is served: unified prefill, PD-decode prebuilt, or dLLM."""
    return rng.choices(["unified", "pd_decode", "dllm"], weights=[6, 2, 2])[0]


def make_req(
    rng: random.Random,
    req_id: int,
    sampling: SamplingParams,
    stream: bool,
    metrics: bool,
    now: float,
    stats_pending: StatsPending,
    embedding: bool = False,
    logprob: LogprobParams | None = None,
) -> Req:
    # Prompt logprobs cost one entry per prompt position: their prompts are kept short.
    short = logprob is not None and logprob.logprob_start_len >= 0
    media = []
    if rng.random() < 0.2:
        for kind in ("image", "audio", "video"):
            if rng.random() < 0.5:
                tokens = rng.randint(1, 12 if short else 64)
                media.append(MediaItem(kind=kind, num_tokens=tokens))  # type: ignore[arg-type]
    longest = 48 if short else 300
    prompt_len = rng.randint(1, longest) + sum(m.num_tokens for m in media)
    return Req(
        rid=f"sim-{req_id}",
        req_id=req_id,
        input_ids=rng.choices(TOKEN_POOL, k=prompt_len),  # one call: prompts are most of the draws
        sampling=sampling,
        stream=stream,
        stream_interval=rng.randint(1, 3),
        arrival_time=now,
        stats_pending=stats_pending,
        media=tuple(media),
        collect_time_stats=metrics,
        is_embedding=embedding,
        logprob=logprob,
    )


def lifecycle(world: SimWorld, req: Req, stop_token: int, kind: str) -> Step:
    rng = world.rng
    block = rng.randint(2, 4) if kind == "dllm" else 1
    pressure = EOS_PRESSURE if rng.random() < 0.15 else 0.03
    world.live.add(req)
    world.enter_queue(req)
    for _ in range(rng.randint(0, 2)):
        yield
    if rng.random() < 0.04:  # aborted before admission: a row with no tokens
        yield from abort_waiting(world, req)
        return
    if not (yield from admit(world, req, kind, first=True)) and not (
        yield from readmit(world, req, kind)
    ):
        return
    while True:
        roll = rng.random()
        if roll < 0.04:
            world.finish(req, FinishAbort(message="aborted by client", status_code=499))
        elif roll < 0.10 and len(req.output_ids) > 0:
            world.retract(req)
            if not (yield from readmit(world, req, kind)):
                return
        elif roll < 0.13:
            ts = req.stats.time_stats
            if ts is not None:
                req.update_time_stats(
                    storage_prefetch_wait=ts.storage_prefetch_wait + rng.random() / 100
                )
        if not req.finished:
            for _ in range(block):
                if append_token(world, req, stop_token, pressure):
                    break
            if kind == "dllm" and not req.finished:
                # A committed block extends what the cache holds for this request.
                world.set_cached(req, req.stats.cached_tokens + block)
        world.emit_if_due(req)
        if req.finished:
            world.live.discard(req)
            return
        yield


def readmit(world: SimWorld, req: Req, kind: str) -> Admission:
    """A retracted request waits, then re-prefills (and again when retracted mid-prefill
    once more); False when it was aborted while it waited."""
    rng = world.rng
    while True:
        for _ in range(rng.randint(1, 3)):
            yield
        if rng.random() < 0.15:  # aborted while it waits to re-prefill
            yield from abort_waiting(world, req)
            return False
        if (yield from admit(world, req, kind, first=False)):
            return True


def abort_waiting(world: SimWorld, req: Req) -> Step:
    """An abort that finds the request in the waiting queue: its finished row comes at once."""
    world.finish(req, FinishAbort(message="aborted by client", status_code=499))
    world.emit_if_due(req)
    world.live.discard(req)
    return
    yield  # a generator, like every lifecycle part


def embedding_lifecycle(world: SimWorld, req: Req) -> Step:
    """An embedding request: queue, prefill in chunks, then one finished row with stats."""
    world.enter_queue(req)
    for _ in range(world.rng.randint(0, 2)):
        yield
    world.leave_queue(req)
    for _ in range(world.rng.randint(0, 3)):
        yield
    req.update_time_stats(prefill_finished_time=world.now)
    if world.rng.random() < 0.05:
        world.finish(req, FinishAbort(message="aborted by client", status_code=499))
    else:
        world.finish(req, FinishLength(length=0))
    world.embedding_rows.append(req)


def admit(world: SimWorld, req: Req, kind: str, *, first: bool) -> Admission:
    """Queue exit, (re-)prefill in chunks without rows, then the step that emits. False
    when the request was retracted mid-prefill (it is back in the waiting queue)."""
    rng = world.rng
    world.leave_queue(req)
    # Where the (re-)prefill starts: the prefix cache never covers a position whose
    # logits prompt logprobs still need (``Req.cache_match_limit``), nor the last token,
    # whose logits give the next one.
    limit = min(req.cache_match_limit, req.seq_len - 1)
    start = rng.randint(0, limit)
    if kind == "pd_decode":
        # Prebuilt: the KV arrives from the prefill server, which reports its cached tokens.
        world.set_cached(req, rng.randint(0, len(req.origin_input_ids) - 1))
        req.update_time_stats(
            bootstrap_done_time=world.now, decode_prebuilt_finish_time=world.now + 0.001
        )
    elif first:
        device = rng.randint(0, len(req.origin_input_ids) - 1) if rng.random() < 0.5 else 0
        host = rng.randint(0, 8) if device and rng.random() < 0.3 else 0
        storage = (
            rng.randint(0, 8) if device and world.storage_backend and rng.random() < 0.3 else 0
        )
        if device + host + storage > limit:
            device, host, storage = min(device, limit), 0, 0
        if storage:  # read from storage files before the prefill
            ts = req.stats.time_stats
            if ts is not None:
                req.update_time_stats(
                    storage_prefetch_wait=ts.storage_prefetch_wait + rng.random() / 100
                )
        world.set_cached(req, device, host, storage)
        start = device + host + storage
    # Chunked prefill: no row until the last chunk. A prefilling request is the first a
    # scheduler retracts when the KV pool runs short.
    chunks = rng.randint(0, 3)
    cuts = [start, *sorted(rng.randint(start, req.seq_len) for _ in range(chunks)), req.seq_len]
    for lo, hi in itertools.pairwise(cuts[:-1]):
        world.prefill(req, lo, hi)
        yield
        if kind == "unified" and rng.random() < 0.05:
            world.retract(req)
            return False
    world.prefill(req, cuts[-2], cuts[-1])
    ts = req.stats.time_stats
    if ts is not None and ts.prefill_finished_time is None:
        req.update_time_stats(prefill_finished_time=world.now)
    return True


def append_token(world: SimWorld, req: Req, stop_token: int, pressure: float) -> bool:
    """One generated token and the real stop checks; True when the request finished.
    ``pressure``: the share of draws that would stop it (EOS or one of its stop ids)."""
    rng = world.rng
    s = req.sampling
    roll = rng.random()
    if roll < pressure:
        token = rng.choice((stop_token, *s.stop_token_ids))
    elif world.planned.get(req.req_id):
        token = world.planned[req.req_id].pop(0)
    elif s.stop and roll < pressure + 0.05:
        # One of its stop strings spelled out, a run of special tokens between each two of
        # its tokens: skipped, they have no text, and the stop must match all the same.
        first, *rest = world.tokens_of(rng.choice(s.stop))
        world.planned[req.req_id] = [
            t for piece in rest for t in (*rng.choices(SPECIAL_TOKENS, k=rng.randint(0, 3)), piece)
        ]
        token = first
    elif roll < 0.4 and s.stop:
        token = rng.choice(world.stop_pieces)
    else:
        token = rng.randint(6, 4095)
    # The sampler never draws what min_new_tokens bans: any other token takes its place.
    bans = world.stop_checker.min_new_bans_of([s], [len(req.output_ids)])
    if bans is not None:
        while token in bans.ids:
            token = rng.randint(6, 4095)
    req.output_ids.append(token)
    if req.logprob is not None:  # as the sampling step keeps them, one entry per token
        req.pending_logprobs.append(
            token_logprobs(
                req.req_id, OUTPUT, [len(req.output_ids) - 1], req.logprob, world.vocab_size
            )
        )
    reason = world.stop_checker.check(req)
    if reason is not None:
        world.finish(req, reason)
    return req.finished


def expected_text(tokenizer: LoadedTokenizer, req: Req) -> str:
    """The whole text a finished request must show, from its tokens by plain decodes (none
    of the pipeline's incremental code): a trimmed stop token left out; a stop string cut
    at the earliest occurrence of any of the request's stop strings that ends past the text
    of its first ``min_new_tokens - 1`` tokens (what came before may hold one). Where the
    decode shows U+FFFD (bytes that are no character), so must the text: a finished text is
    the decode of its ids."""
    s, reason, ids = req.sampling, req.finished_reason, req.output_ids
    skip = s.skip_special_tokens
    if isinstance(reason, FinishStop) and isinstance(reason.matched, int) and not s.no_stop_trim:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip)
    # Occurrences of its stop strings that end past the text of the first min_new_tokens - 1
    # tokens (what came before may hold one).
    allowed = len(tokenizer.decode(ids[: max(s.min_new_tokens - 1, 0)], skip))
    starts = [at for stop in s.stop for at in _occurrences(text, stop) if at + len(stop) > allowed]
    if isinstance(reason, FinishStop) and isinstance(reason.matched, str):
        assert starts, (
            f"{req.rid}: finished on {reason.matched!r} but its text {text!r} holds no such stop"
        )
        # The first of them ends in the last token's text: the checker missed none before.
        before_last = len(tokenizer.decode(ids[:-1], skip))
        first = min(starts)
        assert any(
            text.startswith(stop, first) and first + len(stop) > before_last for stop in s.stop
        ), (
            f"{req.rid}: a stop string at {first} of {text!r} was missed before the one it "
            "finished on"
        )
        return text if s.no_stop_trim else text[:first]
    # No other finish leaves a stop string in what the checker saw: a stop token's own text
    # is not looked at (its stop came first).
    if isinstance(reason, FinishStop) and s.no_stop_trim:
        checked = tokenizer.decode(ids[:-1], skip)
        starts = [
            at for stop in s.stop for at in _occurrences(checked, stop) if at + len(stop) > allowed
        ]
    assert not starts, (
        f"{req.rid}: finished with {reason} though its text {text!r} holds a stop string at "
        f"{starts}"
    )
    return text


def _occurrences(text: str, sub: str) -> list[int]:
    out, at = [], text.find(sub)
    while at >= 0:
        out.append(at)
        at = text.find(sub, at + 1)
    return out
