"""The scheduler's view of one request, and the one place that decides when its stats are
sent.

Invariants:
- Every stats value is changed through ``update_stats`` / ``update_time_stats``, which
  replace the frozen ``RequestOutputStats`` and bump ``stats_epoch``.
- ``take_request_stats_due`` is the only code that decides whether a row carries stats,
  and the only code that records a send. Every output path builds its rows through it.
- A request is in its scheduler's ``StatsPending`` set exactly while its next row is due
  to carry stats; the set is handed to it at construction, never shared between schedulers.
"""

from __future__ import annotations

import random
import time
import weakref
from typing import TYPE_CHECKING, Protocol

import msgspec
import torch

from pipeline.control_frames import LoraAdapter
from pipeline.io_struct import (
    Constraint,
    DecodeOptions,
    LogprobParams,
    FinishReason,
    MediaItem,
    RequestOutputStats,
    SamplingParams,
    SchedulerTimeStats,
)
from pipeline.logprob_columns import TokenLogprobs
from scheduler_proc.pd_state import DecodeBootstrap, KVFetchJob, PdState
from scheduler_proc.dllm_block import Block

if TYPE_CHECKING:  # the grammar engine is the scheduler's; a Req only holds its matcher
    import xgrammar

    from scheduler_proc.sampling.reasoning_gate import ReasoningGate

_replace = msgspec.structs.replace
_SEED_MASK = (1 << 64) - 1


class PrefixNode(Protocol):
    """The prefix-cache node a request holds locked from its admission until its KV is
    released (``scheduler_proc.cache.radix_cache.RadixNode``): the cache sets and reads it,
    a request only carries it."""

    lock_ref: int


class StatsPending(weakref.WeakSet["Req"]):
    """The requests of one scheduler whose next row is due to carry stats: added by the
    stats setter, at creation and at the finish; removed by ``take_request_stats_due`` when
    it records a send. While it is empty no row of that scheduler is due, and the output
    builder skips asking each request (the steady decode step). Weak, so a request dropped
    without a final row cannot leak."""


class Req:
    __slots__ = (
        "rid",
        "req_id",
        "origin_input_ids",
        "sampling",
        "stream",
        "stream_interval",
        "arrival_time",
        "output_ids",
        "num_sent_tokens",
        "finished_reason",
        "kv_slots",
        "num_computed",
        "prefix_node",
        "seed",
        "logprob",
        "pending_logprobs",
        "prompt_logprobs",
        "prompt_logprobs_next",
        "stats_epoch",
        "request_stats_retraction_count",
        "_stats_epoch_sent",
        "_stats",
        "_decode_options_sent",
        "_queue_stay_open",
        "is_embedding",
        "admitted_once",
        "cached_by_tier",
        "hidden_sum",
        "dllm_block",
        "pd",
        "constraint",
        "cache_salt",
        "priority",
        "lora",
        "lora_slot",
        "matcher",
        "gate",
        "_stats_pending",
        "__weakref__",
    )

    def __init__(
        self,
        *,
        rid: str,
        req_id: int,
        input_ids: list[int],
        sampling: SamplingParams,
        stream: bool,
        stream_interval: int,
        arrival_time: float,
        stats_pending: StatsPending,
        media: tuple[MediaItem, ...] = (),
        collect_time_stats: bool = True,
        is_embedding: bool = False,
        logprob: LogprobParams | None = None,
        constraint: Constraint | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        self.rid = rid
        self.req_id = req_id
        self.origin_input_ids = input_ids
        self.sampling = sampling
        self.stream = stream
        self.stream_interval = sampling.stream_interval or stream_interval
        self.arrival_time = arrival_time
        self.is_embedding = is_embedding
        # Its tenant's prefix-cache salt (it shares cached KV only with the same salt), and
        # its priority under priority scheduling (docs/design/tenancy.md).
        self.cache_salt = cache_salt
        self.priority = priority
        self._init_progress()
        self._init_draws(logprob, constraint)
        self._init_features()
        self._init_stats(media, collect_time_stats, stats_pending)

    def _init_progress(self) -> None:
        """Nothing generated, sent or computed yet."""
        self.output_ids: list[int] = []
        self.num_sent_tokens = 0
        self.finished_reason: FinishReason | None = None
        # KV pool slots of the tokens computed so far (prompt, then generated tokens).
        self.kv_slots: torch.Tensor | None = None
        self.num_computed = 0
        self.prefix_node: PrefixNode | None = None  # radix-cache node locked for this request
        self.admitted_once = False  # the prefix-cache hit is counted at the first admission only
        self.cached_by_tier = (0, 0, 0)  # of cached_tokens: (device, host, storage) hits
        self._decode_options_sent = False
        self._queue_stay_open = False  # between enter_waiting_queue and leaving the queue

    def _init_draws(self, logprob: LogprobParams | None, constraint: Constraint | None) -> None:
        """What each draw needs: its seed, the logprobs asked and the constraint."""
        # The seed of every draw (docs/design/sampling.md): the client's, or a random one
        # fixed at arrival, so an unseeded request takes the same counter-based path as a
        # seeded one. Any integer a client sends is a seed: the draws read its low 64 bits.
        seed = self.sampling.seed
        self.seed = (seed if seed is not None else random.getrandbits(64)) & _SEED_MASK
        # Logprobs asked (None: none), and those of generated tokens not yet in a row (while
        # the request is in the running batch, its row holds them: running_batch.py).
        self.logprob: LogprobParams | None = logprob
        self.pending_logprobs: list[TokenLogprobs] = []
        # Prompt logprobs (logprob_start_len s >= 0): those of prompt positions max(s, 1)
        # on, each predicted by the position before it; ``prompt_logprobs_next`` is the next
        # predicting position to compute (None: none asked, or all computed).
        self.prompt_logprobs: list[TokenLogprobs] = []
        start = logprob.logprob_start_len if logprob is not None else -1
        first = max(start, 1)
        self.prompt_logprobs_next: int | None = (
            first - 1 if 0 <= start and first < len(self.origin_input_ids) else None
        )
        # Structured output: what the output must spell, and once its grammar is compiled
        # the matcher, which has accepted exactly ``output_ids`` (a re-prefill accepts
        # nothing again; scheduler_proc/sampling/grammar.py); or, with a reasoning end, the
        # output after it, and until then the grammar waits in ``gate`` (reasoning_gate.py).
        self.constraint = constraint
        self.matcher: xgrammar.GrammarMatcher | None = None
        self.gate: ReasoningGate | None = None

    def _init_features(self) -> None:
        """The state a mode or a role keeps on the request, empty until it sets it."""
        self.hidden_sum: torch.Tensor | None = None  # embedding requests: sum over prompt tokens
        self.dllm_block: Block | None = None  # --mode dllm: the block being refined
        self.pd: PdState = None  # its part in PD disaggregation (pd_state.py)
        # The LoRA adapter it runs with (None: the base model), and the device slot that
        # holds it while the request is live (-1: none yet; scheduler_proc/lora_queue.py).
        self.lora: LoraAdapter | None = None
        self.lora_slot = -1

    def _init_stats(
        self, media: tuple[MediaItem, ...], collect_time_stats: bool, stats_pending: StatsPending
    ) -> None:
        """Its first stats, due with its first output."""
        self.stats_epoch = 0
        self.request_stats_retraction_count: int | None = None
        self._stats_epoch_sent: int | None = None
        counts = {"image": 0, "audio": 0, "video": 0}
        for item in media:
            counts[item.kind] += item.num_tokens
        self._stats = RequestOutputStats(
            prompt_tokens=len(self.origin_input_ids),
            image_tokens=counts["image"],
            audio_tokens=counts["audio"],
            video_tokens=counts["video"],
            time_stats=SchedulerTimeStats() if collect_time_stats else None,
        )
        self._stats_pending = stats_pending
        stats_pending.add(self)  # the first output is always due

    # --- stats: one setter, one decision point ------------------------------------------

    @property
    def stats(self) -> RequestOutputStats:
        return self._stats

    @property
    def retraction_count(self) -> int:
        return self._stats.num_retractions

    def update_stats(self, **changes: object) -> None:
        """The only way a stats value changes. Bumping the epoch makes the next row of this
        request carry the new value, however the value changed."""
        self._stats = _replace(self._stats, **changes)
        self.stats_epoch += 1
        self._stats_pending.add(self)

    def update_time_stats(self, **changes: object) -> None:
        """Time stats exist only when metrics are on; otherwise this costs nothing."""
        time_stats = self._stats.time_stats
        if time_stats is not None:
            self.update_stats(time_stats=_replace(time_stats, **changes))

    def take_request_stats_due(self) -> RequestOutputStats | None:
        """Stats for the row being built now, or None when this row needs none.

        Due on the first output, on the first output after a retraction or after any
        other stats change (the epoch), and on the finished row. Records the send.
        """
        if (
            self.finished_reason is None
            and self.stats_epoch == self._stats_epoch_sent
            and self.request_stats_retraction_count == self._stats.num_retractions
        ):
            return None
        self.request_stats_retraction_count = self._stats.num_retractions
        self._stats_epoch_sent = self.stats_epoch
        self._stats_pending.discard(self)
        return self._stats

    def take_pending_logprobs(self) -> TokenLogprobs | None:
        """The logprobs of the tokens this row carries (all generated since the last row),
        handed over once: a retraction never resends or recomputes them."""
        if not self.pending_logprobs:
            return None
        part = TokenLogprobs.join(self.pending_logprobs)
        self.pending_logprobs = []
        return part

    @property
    def cache_match_limit(self) -> int:
        """How many leading tokens may come from the prefix cache: the positions whose
        logits prompt logprobs need are computed, never cached."""
        if self.prompt_logprobs_next is None:
            return len(self.origin_input_ids) + len(self.output_ids)
        return self.prompt_logprobs_next

    def take_prompt_logprobs(self) -> TokenLogprobs | None:
        """The prompt logprobs, on the request's first row (once all are computed)."""
        if not self.prompt_logprobs or self.prompt_logprobs_next is not None:
            return None
        part = TokenLogprobs.join(self.prompt_logprobs)
        self.prompt_logprobs = []
        return part

    def take_decode_options_due(self) -> DecodeOptions | None:
        """The detokenizer's per-request options, on the request's first row only."""
        if self._decode_options_sent:
            return None
        self._decode_options_sent = True
        s = self.sampling
        return DecodeOptions(
            skip_special_tokens=s.skip_special_tokens,
            stop=s.stop,
            no_stop_trim=s.no_stop_trim,
            stream=self.stream,
            logprob_texts=self.logprob is not None and self.logprob.return_text,
        )

    # --- lifecycle events ----------------------------------------------------------------

    def enter_waiting_queue(self, now: float) -> None:
        self._queue_stay_open = True
        self.update_time_stats(wait_queue_entry_time=now)

    def leave_waiting_queue(self, now: float) -> None:
        """Admitted (or its KV installed): the stay ends, and the first one starts the forward."""
        self._close_queue_stay(now, entering_forward=True)

    def _close_queue_stay(self, now: float, *, entering_forward: bool) -> None:
        if not self._queue_stay_open:
            return
        self._queue_stay_open = False
        ts = self._stats.time_stats
        if ts is None or ts.wait_queue_entry_time is None:
            return
        changes: dict[str, float] = {"queue_time": ts.queue_time + (now - ts.wait_queue_entry_time)}
        if entering_forward and ts.forward_entry_time is None:
            changes["forward_entry_time"] = now
        self.update_time_stats(**changes)

    def mark_retracted(self, now: float) -> None:
        self.update_stats(num_retractions=self._stats.num_retractions + 1)
        self.enter_waiting_queue(now)

    def finish(self, reason: FinishReason, now: float | None = None) -> None:
        """Ends the request wherever it is. A request that ends while it waits (an abort
        before admission, or after a retraction) counts that stay in ``queue_time`` too."""
        now = time.time() if now is None else now
        self.finished_reason = reason
        self._stats_pending.add(self)  # the finished row always carries stats
        self._close_queue_stay(now, entering_forward=False)
        self.update_time_stats(completion_time=now)

    # --- token bookkeeping ---------------------------------------------------------------

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV a (re-)prefill must compute: the prompt, then every generated
        token (a retracted request re-prefills what it generated so far)."""
        return self.origin_input_ids + self.output_ids if self.output_ids else self.origin_input_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    # --- its part in PD disaggregation ---------------------------------------------------

    @property
    def kv_only(self) -> bool:
        """A prefill server's re-bootstrap (``KVFetchJob``): it computes KV for a decode
        server, emits no row, and is released as soon as its prefill completes."""
        return isinstance(self.pd, KVFetchJob)

    @property
    def kv_prebuilt(self) -> bool:
        """A decode server's PD request (``DecodeBootstrap``): its KV comes from a prefill
        server, so it matches no prefix here and goes to no cache when released."""
        return isinstance(self.pd, DecodeBootstrap)

    def output_due(self) -> bool:
        """Whether this step's tokens go out now (docs/design/scheduler.md, stream interval)."""
        if self.finished_reason is not None:
            return True
        if not self.stream:
            return False
        if self.num_sent_tokens == 0:
            return True
        return len(self.output_ids) - self.num_sent_tokens >= self.stream_interval

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, req_id={self.req_id}, out={len(self.output_ids)})"
