"""The output-path benchmark's baseline: SGLang's per-row layout, a dataclass of per-row Python
lists of the same fields (rid strings, token lists, stats columns on every row) built by a
per-row loop over the same ``Req`` objects, pickled with the highest protocol and unpickled,
as SGLang's default IPC does; with logprobs, SGLang's per-row lists appended each step."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bench.output_path_steady import TOP_K, Timings
from pipeline.finish_reasons import finish_reason_to_dict
from pipeline.io_struct import CachedTokensDetails
from scheduler_proc.req import Req


@dataclass
class BaselineBatchTokenIDOutput:
    """Per-row Python lists of the same fields, stats columns on every row."""

    rids: list[str]
    output_ids: list[list[int]]
    completion_tokens: list[int]
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    cached_tokens_details: list[dict[str, Any] | None]
    retraction_counts: list[int]
    image_tokens: list[int]
    audio_tokens: list[int]
    video_tokens: list[int]
    # Time stats lists: None with metrics off.
    wait_queue_entry_time: list[float | None] | None = None
    forward_entry_time: list[float | None] | None = None
    prefill_finished_time: list[float | None] | None = None
    queue_time: list[float] | None = None
    # Logprob lists (per row: this row's new tokens'), None when no request asked.
    output_token_logprobs_val: list[list[float]] | None = None
    output_token_logprobs_idx: list[list[int]] | None = None
    output_top_logprobs_val: list[list[list[float]]] | None = None
    output_top_logprobs_idx: list[list[list[int]]] | None = None


@dataclass
class BaselineLogprobs:
    """One request's logprobs as SGLang keeps them on its ``Req``: per-row lists, one
    entry appended per generated token."""

    token_val: list[float]
    token_idx: list[int]
    top_val: list[list[float]]
    top_idx: list[list[int]]
    sent: int = 0  # entries already in an output (SGLang's send offset)


def _details_dict(details: CachedTokensDetails | None) -> dict[str, Any] | None:
    if details is None:
        return None
    out: dict[str, Any] = {"device": details.device, "host": details.host}
    if details.storage is not None:
        out["storage"] = details.storage
        out["storage_backend"] = details.storage_backend
    return out


def build_baseline_output(
    reqs: Sequence[Req], metrics: bool, logprobs: Sequence[BaselineLogprobs] | None = None
) -> BaselineBatchTokenIDOutput:
    """A per-row loop over the requests, as SGLang's output processor does; ``logprobs``
    (one per request): each row also carries its unsent part of the request's lists."""
    rids: list[str] = []
    output_ids: list[list[int]] = []
    completion_tokens: list[int] = []
    finished_reasons: list[dict[str, Any] | None] = []
    prompt_tokens: list[int] = []
    cached_tokens: list[int] = []
    cached_tokens_details: list[dict[str, Any] | None] = []
    retraction_counts: list[int] = []
    image_tokens: list[int] = []
    audio_tokens: list[int] = []
    video_tokens: list[int] = []
    wait_queue_entry_time: list[float | None] = []
    forward_entry_time: list[float | None] = []
    prefill_finished_time: list[float | None] = []
    queue_time: list[float] = []
    token_val: list[list[float]] = []
    token_idx: list[list[int]] = []
    top_val: list[list[list[float]]] = []
    top_idx: list[list[list[int]]] = []
    for i, req in enumerate(reqs):
        rids.append(req.rid)
        if logprobs is not None:
            lp = logprobs[i]
            start, lp.sent = lp.sent, len(lp.token_val)
            token_val.append(lp.token_val[start:])
            token_idx.append(lp.token_idx[start:])
            top_val.append(lp.top_val[start:])
            top_idx.append(lp.top_idx[start:])
        output_ids.append(req.output_ids[req.num_sent_tokens :])
        req.num_sent_tokens = len(req.output_ids)
        completion_tokens.append(len(req.output_ids))
        reason = req.finished_reason
        finished_reasons.append(None if reason is None else finish_reason_to_dict(reason))
        stats = req.stats
        prompt_tokens.append(stats.prompt_tokens)
        cached_tokens.append(stats.cached_tokens)
        cached_tokens_details.append(_details_dict(stats.cached_tokens_details))
        retraction_counts.append(stats.num_retractions)
        image_tokens.append(stats.image_tokens)
        audio_tokens.append(stats.audio_tokens)
        video_tokens.append(stats.video_tokens)
        if metrics:
            ts = stats.time_stats
            assert ts is not None
            wait_queue_entry_time.append(ts.wait_queue_entry_time)
            forward_entry_time.append(ts.forward_entry_time)
            prefill_finished_time.append(ts.prefill_finished_time)
            queue_time.append(ts.queue_time)
    out = BaselineBatchTokenIDOutput(
        rids=rids,
        output_ids=output_ids,
        completion_tokens=completion_tokens,
        finished_reasons=finished_reasons,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        cached_tokens_details=cached_tokens_details,
        retraction_counts=retraction_counts,
        image_tokens=image_tokens,
        audio_tokens=audio_tokens,
        video_tokens=video_tokens,
    )
    if logprobs is not None:
        out.output_token_logprobs_val = token_val
        out.output_token_logprobs_idx = token_idx
        out.output_top_logprobs_val = top_val
        out.output_top_logprobs_idx = top_idx
    if metrics:
        out.wait_queue_entry_time = wait_queue_entry_time
        out.forward_entry_time = forward_entry_time
        out.prefill_finished_time = prefill_finished_time
        out.queue_time = queue_time
    return out


def _append_one_token(reqs: Sequence[Req], token: int) -> None:
    for req in reqs:
        req.output_ids.append(token)


def _keep_baseline_logprobs(
    logprobs: Sequence[BaselineLogprobs], logits: torch.Tensor, token: int
) -> None:
    """SGLang's decode output processing: the batched values as lists, then one append per
    request and list."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp[:, token].tolist()
    top_values, top_ids = lp.topk(TOP_K, dim=1)
    top_val, top_idx = top_values.tolist(), top_ids.tolist()
    for i, row in enumerate(logprobs):
        row.token_val.append(chosen[i])
        row.token_idx.append(token)
        row.top_val.append(top_val[i])
        row.top_idx.append(top_idx[i])


def baseline_variant(
    reqs: list[Req], metrics: bool, logits: torch.Tensor | None = None
) -> Callable[[int], Timings]:
    """``logits``: every request asked for logprobs (top 5), kept as SGLang keeps them."""
    clock = time.perf_counter_ns
    dumps, loads, protocol = pickle.dumps, pickle.loads, pickle.HIGHEST_PROTOCOL
    logprobs = None if logits is None else [BaselineLogprobs([], [], [], []) for _ in reqs]

    def step(token: int) -> Timings:
        _append_one_token(reqs, token)  # set-up, not timed
        if logprobs is not None and logits is not None:  # both or neither
            _keep_baseline_logprobs(logprobs, logits, token)
        t0 = clock()
        out = build_baseline_output(reqs, metrics, logprobs)
        t1 = clock()
        data = dumps(out, protocol=protocol)
        t2 = clock()
        msg = loads(data)
        t3 = clock()
        assert len(msg.rids) == len(reqs) and msg.output_ids[-1] == [token]
        assert (msg.queue_time is not None) == metrics
        if logprobs is not None:
            assert (
                len(msg.output_top_logprobs_idx) == len(reqs)
                and len(msg.output_top_logprobs_idx[-1][0]) == TOP_K
            )
            assert all(len(v) == 1 for v in msg.output_token_logprobs_val)
        return t1 - t0, t2 - t1, t3 - t2, len(data)

    return step
