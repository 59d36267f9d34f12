"""Builds a response's ``meta_info`` (SGLang-compatible names) from ``ReqState`` alone:
per-request numbers from ``request_stats``, latencies from the state's own timing, and
speculative decoding's counts (SGLang's ``spec_*`` keys) once a request has verified drafts."""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.io_struct import RequestOutputStats, SchedulerTimeStats
from pipeline.finish_reasons import finish_reason_to_dict
from tokenizer_proc.req_state import ReqState, StreamChunk


def build_meta_info(state: ReqState, interim: StreamChunk | None = None) -> dict[str, Any]:
    """The request's meta_info now. ``interim``: that of a stream event before the last one
    instead, with the completion count and stats through that event and no finish (the
    finish goes on the last event only, even when several events are sent at once)."""
    stats = state.request_stats if interim is None else interim.stats
    assert stats is not None, "meta_info is only built once the request has stats"
    details = stats.cached_tokens_details
    finished_time = state.finished_time if interim is None else None
    finished = finished_time is not None
    meta: dict[str, Any] = {
        "id": state.rid,
        "finish_reason": finish_reason_to_dict(state.finished_reason)
        if finished and state.finished_reason
        else None,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": state.completion_tokens
        if interim is None
        else interim.completion_tokens,
        "cached_tokens": stats.cached_tokens,
        "cached_tokens_details": msgspec.to_builtins(details) if details is not None else None,
        "num_retractions": stats.num_retractions,
        # SGLang's key: here the version of the weights that made the tokens so far (the
        # scheduler's, through the stats), not the server's at the time of the answer.
        "weight_version": stats.weight_version,
    }
    for kind, count in (
        ("image_tokens", stats.image_tokens),
        ("audio_tokens", stats.audio_tokens),
        ("video_tokens", stats.video_tokens),
    ):
        if count:
            meta[kind] = count
    if finished_time is not None:
        meta["e2e_latency"] = finished_time - state.created_time
    meta.update(spec_meta_info(stats))

    ts = stats.time_stats
    if ts is None:  # metrics off: no timing keys
        return meta
    meta["queue_time"] = ts.queue_time
    meta["forward_entry_time"] = ts.forward_entry_time
    meta["prefill_finished_time"] = ts.prefill_finished_time
    meta["storage_prefetch_wait"] = ts.storage_prefetch_wait
    if (
        ts.bootstrap_done_time is not None
    ):  # PD decode: when the KV arrived, and when it was installed
        meta["bootstrap_done_time"] = ts.bootstrap_done_time
        meta["decode_prebuilt_finish_time"] = ts.decode_prebuilt_finish_time
    if finished:
        first = state.first_token_time
        meta["first_token_latency"] = (first - state.created_time) if first is not None else None
        meta["request_received_ts"] = state.created_time
        meta["request_finished_ts"] = state.finished_time
        meta["decode_throughput"] = decode_throughput(state.completion_tokens, ts)
    return meta


def spec_meta_info(stats: RequestOutputStats) -> dict[str, int | float]:
    """SGLang's speculative keys, only for a request that had drafts verified (the scheduler
    sets the counts when the request leaves the running batch: the last answer carries them).
    ``spec_verify_ct``: verify passes with drafts; ``spec_accept_length``: tokens per such pass
    (accepted drafts and the target's own token). SGLang divides completion_tokens by
    spec_verify_ct, the same where every decode step verifies drafts; here a step may draft
    nothing for a request (no n-gram match, a large batch), whose token that would count."""
    verify_ct = stats.spec_verify_ct
    if verify_ct <= 0:
        return {}
    accepted, drafted = stats.spec_accepted_tokens, stats.spec_draft_tokens
    return {
        "spec_verify_ct": verify_ct,
        "spec_accept_length": (accepted + verify_ct) / verify_ct,
        "spec_accept_rate": accepted / drafted if drafted else 0.0,
        "spec_accept_token_num": accepted,
        "spec_draft_token_num": drafted,
    }


def decode_throughput(completion_tokens: int, ts: SchedulerTimeStats) -> float:
    """Scheduler-side tokens per second after the first token (``decode_interval``); 0.0
    when there is no such interval."""
    interval = decode_interval(completion_tokens, ts)
    return interval[1] / interval[0] if interval is not None else 0.0


def time_per_output_token(completion_tokens: int, ts: SchedulerTimeStats) -> float | None:
    """Scheduler-side seconds per token after the first (``decode_interval``); None when
    there is no such interval."""
    interval = decode_interval(completion_tokens, ts)
    return interval[0] / interval[1] if interval is not None else None


def decode_interval(completion_tokens: int, ts: SchedulerTimeStats) -> tuple[float, int] | None:
    """(seconds, tokens) of decoding after the first token: from the first prefill's end to
    the completion, and completion_tokens - 1. Measured where the tokens are made, so it
    means the same for streaming and non-streaming requests (whose only row may be the
    last); None when there is no positive interval or no token after the first."""
    if ts.prefill_finished_time is None or ts.completion_time is None or completion_tokens <= 1:
        return None
    span = ts.completion_time - ts.prefill_finished_time
    return (span, completion_tokens - 1) if span > 0 else None
