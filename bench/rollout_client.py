"""The rollout benchmark's HTTP side (bench/rollout.py): streaming /generate read into a
``Stream`` (tokens so far, finish, weight version), the controls of one weight update
(pause retract, update from disk, continue) timed one by one, and the server's own rollout
metrics read from /metrics."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# What the server's own metrics say: its update seconds (control to swap) and its seconds
# without steps.
UPDATE_SUM = "tokenpipe:weight_update_duration_seconds_sum"
UPDATE_COUNT = "tokenpipe:weight_update_duration_seconds_count"
PAUSED_TOTAL = "tokenpipe:paused_seconds_total"


def stream_client(url: str) -> httpx.AsyncClient:
    """No read timeout: a stream waits out a pause."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=30.0), limits=limits)


async def control(ctl: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[float, Any]:
    """POSTs a control: (seconds to its answer, the answer). A refusal ends the run."""
    t0 = time.perf_counter()
    resp = await ctl.post(path, json=body)
    seconds = time.perf_counter() - t0
    answer = resp.json()
    if resp.status_code != 200 or answer.get("success") is False:
        raise RuntimeError(f"POST {path} {body}: HTTP {resp.status_code}: {answer}")
    return seconds, answer


async def metric_totals(ctl: httpx.AsyncClient) -> dict[str, float]:
    """The server's update-seconds sum and count and paused seconds (over label sets)."""
    totals: dict[str, float] = {}
    for line in (await ctl.get("/metrics")).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (UPDATE_SUM, UPDATE_COUNT, PAUSED_TOTAL):
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    if len(totals) < 3:
        raise RuntimeError(f"/metrics lacks the rollout series (has {sorted(totals)})")
    return totals


@dataclass(frozen=True)
class UpdateTiming:
    total_s: float  # from sending the pause to the continue's answer
    pause_s: float
    update_s: float
    continue_s: float
    paused_requests: int  # the server's count of requests it held (the update's answer)


async def update_once(ctl: httpx.AsyncClient, path: str, version: str) -> UpdateTiming:
    """POST /pause_generation (retract), /update_weights_from_disk, /continue_generation."""
    t0 = time.perf_counter()
    pause_s, _ = await control(ctl, "/pause_generation", {"mode": "retract"})
    body = {"model_path": path, "weight_version": version, "abort_all_requests": False}
    update_s, answer = await control(ctl, "/update_weights_from_disk", body)
    continue_s, _ = await control(ctl, "/continue_generation", {})
    total = time.perf_counter() - t0
    return UpdateTiming(total, pause_s, update_s, continue_s, answer["num_paused_requests"])


@dataclass
class Stream:
    """One streaming /generate as far as it was read."""

    tokens: int = 0  # completion_tokens of the last event read
    finished: bool = False  # an event with a finish_reason came
    weight_version: str | None = None  # the last event's
    error: str | None = None
    begun: asyncio.Event = field(default_factory=asyncio.Event)  # its first event (or its end)


async def stream_generate(
    client: httpx.AsyncClient, body: dict[str, Any], s: Stream, until: float = math.inf
) -> None:
    """Reads the stream into ``s``; stops, not counting it, at an event after ``until``
    (time.monotonic()). A stream that ends unfinished otherwise is an error."""
    try:
        async with client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                s.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if time.monotonic() > until:
                    return
                if line.startswith("data:") and not line.endswith("[DONE]"):
                    read_event(json.loads(line[5:]), s)
                    s.begun.set()
        if not s.finished and s.error is None:
            s.error = "the stream ended without a finish_reason"
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    finally:
        s.begun.set()


def read_event(event: dict[str, Any], s: Stream) -> None:
    if "error" in event:
        s.error = f"stream error: {event['error'].get('message')}"
        return
    meta = event["meta_info"]
    s.tokens = meta["completion_tokens"]
    s.weight_version = meta.get("weight_version")
    s.finished = meta.get("finish_reason") is not None


def stream_fault(s: Stream, want: int) -> str | None:
    """Why a stream read to its end is wrong, or None."""
    if s.error is not None:
        return s.error
    if not s.finished:
        return "unfinished"
    return None if s.tokens == want else f"finished with {s.tokens} tokens, wanted {want}"
