"""End-to-end serving benchmark: N concurrent HTTP clients against a running server.

``--url`` drives a server that is already running; ``--launch`` starts ``tokenpipe serve``
on a free port (extra flags through ``--server-args "..."``) and stops it at the end. A
router (sglang-router in front of a PD pair, say) serves no ``/server_info``: with
``--url ROUTER --info-url SERVER`` the vocabulary size comes from a server behind it, and
no step rate is measured.

Each of ``--concurrency`` clients sends requests one after the other until ``--requests``
have been sent: ``--prompt-len`` random token ids (different for every request, so the
prefix cache cannot share them), ``--max-new-tokens`` with ``ignore_eos``, ``--temperature``
(default 0.7), ``--top-p`` (default: not sent, the server's 1.0) and, unless
``--no-seeded``, a distinct seed per request (``--seed`` plus its index); a
``--stream-ratio`` fraction of them streaming. Per request it
measures (client side) TTFT (send to the first SSE event with tokens; a non-streaming
request's whole response), ITL (the gap before each later event divided by the tokens in
it), end-to-end latency and the tokens received. A request whose ``output_ids`` (summed
over the events of a stream) differ from its final ``meta_info.completion_tokens`` counts
as tokens lost.

``--api completions`` sends the same workload to ``/v1/completions`` instead (default
``generate``): the prompt as token ids, ``max_tokens``, ``ignore_eos``, ``temperature``,
``top_p`` and ``seed`` as above, and on streams ``stream_options: {"include_usage": true,
"continuous_usage_stats": true}``. A chunk's text holds one or more tokens (or none yet)
and the server sends no token ids in completions chunks, so an event's tokens are its
``usage.completion_tokens`` less the previous event's; a stream whose final usage chunk
disagrees with their sum counts as tokens lost. (That checks the count the chunks carry,
not their text.) A non-streaming completion has only its usage: nothing is lost by this
measure there.

**CPU per process.** With ``--launch`` the server's processes are its supervisor's
children, named by role from /proc/PID/cmdline: scheduler, detokenizer, api (api-0, api-1,
... in start order when ``--api-workers`` runs several). With ``--url``, ``--pids`` names
them (a supervisor's pid stands for its children); without it only the client is measured.
Each process's utime + stime (/proc/PID/stat, all threads, in clock ticks, 1/SC_CLK_TCK s:
10 ms on Linux) and the client's own (getrusage) are read at the two moments that bound the
steady part of the run (below: every client has a request in flight, then the first client
runs out of work), in the client's event loop between two events. The report gives each
one's CPU-seconds and cores (CPU-s / window-s), and **tokens per API CPU-second**: the
output tokens the clients received in that window (by each event's arrival time) over the
CPU-seconds of all API processes together in it. Arrival is when the client parsed the
event, a little after the API sent it, which matters only at the window's edges.
CPU-seconds are much steadier than wall-clock rates on a shared machine.

The scheduler step rate comes from ``scheduler.forward_steps_total`` in ``/server_info``
(the scheduler's stats report: about every 0.5 s while it works, and one when it runs out
of work). The counter is cumulative, so readings at two moments give the steps between
them: one before the run (the scheduler idle after a warm-up request), one after it (the
report sent when the run's work was done, waited for up to ``SETTLE_TIMEOUT``), and each
report polled in between, timed by the first poll that saw it. The rate is taken between
the last reading at or before the steady part of the run starts (every client has a
request in flight) and the first at or after it ends (the first client runs out of work):
the steady part on a long run, the whole run on one shorter than the report interval.

``--compare-discard`` (with ``--launch``) then starts a second server with the same flags
plus ``--discard-output``: its scheduler builds and encodes every frame but drops it, so
no client ever gets output. Streaming requests are kept at the same number live in that
scheduler (topped up from the ``live_reqs`` it reports) for the same duration, then, once
every request sent has reached the scheduler, ``/abort_request {"abort_all": true}`` ends
the work, the step rate is taken the same way (the run ends at the abort), the hanging
clients are cancelled and the server is stopped. The ratio of the two step rates is what
the output path costs the scheduler; the target is >= 0.95x at 256 streams.

``--compare-sampling`` (with ``--launch``) then runs the same workload on the same server
greedy (temperature 0, no seed) and sampled (temperature 0.7, top_p 0.9, seeded; a
``--temperature``, ``--top-p`` or ``--[no-]seeded`` given replaces its part), in
``--rounds`` (default 2; ``--sampling-rounds`` is the same flag) rounds of one run each, the order swapped from one round
to the next so neither always goes first. Every run has its own prompts, so none finds
another's in the prefix cache; the main run before them warms the server up. It reports
the output tokens/s of each and the ratio sampled/greedy, medians over the rounds; the
target is >= 0.9x at 256 streams.

``--top-logprobs K`` (with ``--launch``) then runs, the same way and on the same server, the
workload as given (``without``) against the same with ``return_logprob`` and
``top_logprobs_num`` K on every request (``logprobs``), in ``--rounds`` rounds; it reports
the ratio logprobs/without of output tokens/s (target >= 0.9x at 256 streams with K = 5;
vLLM measured 0.73x). A logprobs request whose ``output_token_logprobs`` (summed over its
events) do not number its tokens counts as logprobs lost.

``--compare-api-workers N`` (with ``--launch``) then starts a second server with the same
flags plus ``--api-workers N`` (N API processes sharing the port; with N = 1 no flag is
passed, one API process being the default) while the main one stays up: both on their own
ports, and an idle server takes next to no CPU, so the rounds alternate between them
without a restart (``--rounds`` of one run on each, order swapped each round, prompts of
their own). It reports each server's output tokens/s and the ratio multi/single (medians),
and each server's per-API-process cores and tokens per API CPU-second (medians over
rounds). ``--server-args`` must not hold ``--api-workers`` then: the main server is the
one-process arm.

Usage: ``python bench/serve.py --launch [--api generate|completions] [--concurrency 64]
[--requests N] [--stream-ratio 0.5] [--max-new-tokens 64] [--prompt-len 32]
[--temperature 0.7] [--top-p P] [--[no-]seeded] [--compare-discard] [--compare-sampling]
[--top-logprobs K] [--compare-api-workers N] [--rounds 2] [--json PATH] [--plot PATH.png]
[--no-progress] [--server-args "..."]``, or ``--url URL [--pids PID,...]`` for a running
server.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import math
import os
import random
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvloop
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.launch import LaunchedServer, cmdline_role, descendants  # noqa: E402

POLL_INTERVAL = 0.1  # /server_info sampling; the scheduler reports about every 0.5 s
SETTLE_TIMEOUT = 5.0  # for the report the scheduler sends once a run's work is done
TARGET_RATIO = 0.95  # attached/discarded scheduler steps/s
TARGET_SAMPLING_RATIO = 0.9  # sampled/greedy output tokens/s
TARGET_LOGPROBS_RATIO = 0.9  # with top-5 logprobs / without, output tokens/s (vLLM: 0.73x)
MAX_TOP_LOGPROBS = 20  # the server's limit on top_logprobs_num
TARGET_STREAMS = 256
DEFAULT_TEMPERATURE = 0.7
# --compare-sampling's sampled parameters, unless given.
SAMPLED_TEMPERATURE = 0.7
SAMPLED_TOP_P = 0.9
SAMPLED_SEEDED = True
ENDPOINTS = {"generate": "/generate", "completions": "/v1/completions"}  # --api
# Usage so far on every chunk: a chunk's text holds one or more tokens (or none yet), and
# the default server sends no token ids in completions chunks, so this is how to count them.
CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}
CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc/PID/stat's CPU times are in these ticks
T = TypeVar("T")


@dataclass
class LoadConfig:
    concurrency: int = 64
    requests: int = 256
    stream_ratio: float = 0.5
    max_new_tokens: int = 64
    prompt_len: int = 32
    seed: int = 0
    progress: bool = True
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float | None = None  # None: not sent (the server's default, 1.0)
    seeded: bool = True  # a distinct seed per request: seed + its index
    prompt_set: int = 0  # runs on one server with different sets share no prompt
    top_logprobs: int | None = None  # None: no logprobs asked; K: return_logprob, top_logprobs_num K
    api: str = "generate"  # a key of ENDPOINTS


@dataclass
class ReqResult:
    stream: bool
    ok: bool = False
    status: int = 0
    error: str | None = None
    sent: float = 0.0  # seconds since the run's start
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0  # output_ids received
    completion_tokens: int | None = None  # the final meta_info's count
    logprobs: int | None = None  # output_token_logprobs entries received; None: not asked
    itl: list[float] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, tokens)


@dataclass
class Sample:
    """One /server_info answer: when it was asked and answered, and the scheduler's report."""

    asked: float
    answered: float
    steps: int
    live: int


@dataclass
class Settled:
    """The scheduler's step count once a run's work is done (or before it starts).
    ``confirmed`` False: no report that shows the work done came in time; the count is the
    latest report's and may miss the last steps."""

    steps: int
    confirmed: bool


# --- requests ---------------------------------------------------------------------------------


def make_body(i: int, cfg: LoadConfig, vocab: int, stream: bool) -> dict[str, Any]:
    rng = random.Random(f"{cfg.seed}/{cfg.prompt_set}/{i}")
    ids = [rng.randrange(16, vocab) for _ in range(cfg.prompt_len)]  # low ids hold the special tokens
    if cfg.api == "completions":
        return completions_body(i, cfg, ids, stream)
    sampling: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "ignore_eos": True}
    if cfg.top_p is not None:
        sampling["top_p"] = cfg.top_p
    if cfg.seeded:
        sampling["seed"] = cfg.seed + i
    body = {"input_ids": ids, "sampling_params": sampling, "stream": stream}
    if cfg.top_logprobs is not None:
        body.update(return_logprob=True, top_logprobs_num=cfg.top_logprobs)
    return body


def completions_body(i: int, cfg: LoadConfig, ids: list[int], stream: bool) -> dict[str, Any]:
    """The same request as ``make_body``'s /generate one, as a /v1/completions body."""
    assert cfg.top_logprobs is None, "logprobs are measured through /generate"
    body: dict[str, Any] = {"prompt": ids, "max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "ignore_eos": True}
    if cfg.top_p is not None:
        body["top_p"] = cfg.top_p
    if cfg.seeded:
        body["seed"] = cfg.seed + i
    body["stream"] = stream
    if stream:
        body["stream_options"] = dict(CONTINUOUS_USAGE)
    return body


def generate_event_tokens(event: dict[str, Any], res: ReqResult) -> int:
    """A /generate event's tokens (its ``output_ids`` are the ones since the last event);
    keeps its ``meta_info`` count so far and its logprob entries."""
    res.completion_tokens = event["meta_info"]["completion_tokens"]
    if res.logprobs is not None:
        res.logprobs += len(event["meta_info"].get("output_token_logprobs") or ())
    return len(event["output_ids"])


def completions_event_tokens(event: dict[str, Any], res: ReqResult) -> int:
    """A /v1/completions chunk's tokens: its usage so far (``continuous_usage_stats``) less
    the tokens counted before it. The last chunk (no choices) carries the request's usage:
    its ``completion_tokens`` is the final count, checked against the sum."""
    usage = event.get("usage")
    if usage is None:
        raise ValueError("a chunk without usage: the server does not honour stream_options.continuous_usage_stats")
    if not event["choices"]:
        res.completion_tokens = int(usage["completion_tokens"])
        return 0
    return int(usage["completion_tokens"]) - res.tokens


def whole_response_tokens(api: str, data: dict[str, Any], res: ReqResult) -> None:
    """A non-streaming answer's tokens. /v1/completions gives only its usage count (the text
    is not countable in tokens), so nothing can be lost there by this measure."""
    if api == "completions":
        res.tokens = res.completion_tokens = int(data["usage"]["completion_tokens"])
        return
    res.tokens = len(data["output_ids"])
    res.completion_tokens = data["meta_info"]["completion_tokens"]
    if res.logprobs is not None:
        res.logprobs = len(data["meta_info"].get("output_token_logprobs") or ())


async def send_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    t0: float,
    on_headers: Callable[[], None] | None = None,
    api: str = "generate",
) -> ReqResult:
    """One request to ``api``'s endpoint. ``on_headers`` is called when a stream's headers
    arrive: the server has then already handed the request to the scheduler."""
    res = ReqResult(stream=bool(body["stream"]), logprobs=0 if body.get("return_logprob") else None)
    endpoint = f"{url}{ENDPOINTS[api]}"
    event_tokens = completions_event_tokens if api == "completions" else generate_event_tokens
    start = time.perf_counter()
    res.sent = start - t0
    try:
        if not res.stream:
            resp = await client.post(endpoint, json=body)
            now = time.perf_counter()
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return res
            whole_response_tokens(api, resp.json(), res)
            res.ttft = res.e2e = now - start
            res.arrivals.append((now - t0, res.tokens))
            res.ok = True
            return res
        async with client.stream("POST", endpoint, json=body) as resp:
            res.status = resp.status_code
            if on_headers is not None:
                on_headers()
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            last = start
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    res.error = f"stream error: {event['error'].get('message')}"
                    return res
                n = event_tokens(event, res)
                if n == 0:
                    continue
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itl.append((now - last) / n)
                last = now
                res.tokens += n
                res.arrivals.append((now - t0, n))
            res.e2e = time.perf_counter() - start
            if not done:
                res.error = "stream ended without [DONE]"
                return res
            if api == "completions" and res.completion_tokens is None:
                res.error = "stream ended without its usage chunk"
                return res
            res.ok = True
    except Exception as exc:  # noqa: BLE001 - every failure is a counted error
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def read_report(client: httpx.AsyncClient, url: str, t0: float) -> Sample | None:
    """The scheduler's latest report from /server_info; None when the answer has none."""
    asked = time.perf_counter() - t0
    try:
        resp = await client.get(f"{url}/server_info")
        sched = resp.json().get("scheduler") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        sched = None
    if sched is None:
        return None
    return Sample(asked, time.perf_counter() - t0, int(sched["forward_steps_total"]), int(sched["live_reqs"]))


async def sample_loop(url: str, t0: float, out: list[Sample], stop: asyncio.Event) -> None:
    """Polls /server_info until ``stop``; keeps the answers that carry a scheduler report."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        while not stop.is_set():
            sample = await read_report(client, url, t0)
            if sample is not None:
                out.append(sample)
            try:
                await asyncio.wait_for(stop.wait(), POLL_INTERVAL)
            except TimeoutError:
                pass


async def settle(client: httpx.AsyncClient, url: str, older_steps: int, timeout: float) -> Settled | None:
    """The step count once the work handed to the scheduler is done: from the report it
    sends when it runs out of work (no live request), once that report counts more steps
    than ``older_steps``. ``older_steps`` is the count of a report the scheduler sent before
    the last request of the work reached it, which ran at least one step after that: so a
    report from an idle moment before then is not taken, and the count is final (an idle
    scheduler steps no more). Polls up to ``timeout``, then settles for the latest report,
    unconfirmed; None when no report came at all."""
    t0 = time.perf_counter()
    latest: Sample | None = None
    while True:
        sample = await read_report(client, url, t0)
        if sample is not None:
            latest = sample
            if sample.live == 0 and sample.steps > older_steps:
                return Settled(sample.steps, True)
        if time.perf_counter() - t0 >= timeout:
            return Settled(latest.steps, False) if latest is not None else None
        await asyncio.sleep(POLL_INTERVAL)


def latest_steps(start: Settled, samples: Sequence[Sample], before: float) -> int:
    """The count of the latest report seen before ``before`` (the counter only grows)."""
    return max([start.steps, *(s.steps for s in samples if s.answered < before)])


def phase_readings(start: Settled, samples: Sequence[Sample], end: Settled, end_t: float) -> list[tuple[float, int]]:
    """(seconds since the run's start, forward steps): the count before the run at 0, each
    new report at the first sample that saw it, and the count after the run at ``end_t``."""
    out = [(0.0, start.steps)]
    for s in samples:
        if s.answered < end_t and s.steps > out[-1][1]:
            out.append((s.answered, s.steps))
    out.append((end_t, max(end.steps, out[-1][1])))
    return out


def step_rate(readings: Sequence[tuple[float, int]], lo: float, hi: float) -> dict[str, Any] | None:
    """Steps/s between the last reading at or before ``lo`` and the first at or after
    ``hi``: the shortest stretch between two known counts that covers [lo, hi]. The
    readings before and after the run are always there, so a run shorter than the report
    interval gets its rate over the whole run."""
    before = [r for r in readings if r[0] <= lo]
    after = [r for r in readings if r[0] >= hi]
    if not before or not after or after[0][0] <= before[-1][0]:
        return None
    (ta, sa), (tb, sb) = before[-1], after[0]
    return {"steps_per_s": (sb - sa) / (tb - ta), "steps": sb - sa, "window_s": [ta, tb]}


async def prepare(url: str, discarding: bool = False, info_url: str | None = None) -> tuple[int, Settled | None]:
    """The vocabulary size, from the ``/server_info`` of ``info_url`` (a server behind the
    router at ``url``: a router has none of its own) or else of ``url``; and the scheduler's
    step count (None: ``url`` has no scheduler reports, as a router) after one short
    request, so the model's first (slow) forward is not timed. A discarding server never
    answers that request: its report says when it is done."""
    async with httpx.AsyncClient(timeout=120.0) as client:
        resp = await client.get(f"{info_url or url}/server_info")
        resp.raise_for_status()
        info = resp.json()
        vocab = int(info["vocab_size"])
        reports = info_url is None and "scheduler" in info
        older = int(info["scheduler"]["forward_steps_total"]) if reports and info["scheduler"] else 0
        warm = {"input_ids": [16, 17, 18, 19], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        if not discarding:
            (await client.post(f"{url}/generate", json=warm)).raise_for_status()
            return vocab, await settle(client, url, older, SETTLE_TIMEOUT) if reports else None
        task = asyncio.create_task(client.post(f"{url}/generate", json=warm))
        start = await settle(client, url, older, 120.0)  # it includes the first forward
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return vocab, start


def run_step_rate(
    start: Settled | None, samples: Sequence[Sample], end: Settled | None, end_t: float, lo: float, hi: float
) -> dict[str, Any] | None:
    if start is None or end is None:
        return None
    rate = step_rate(phase_readings(start, samples, end, end_t), lo, hi)
    if rate is not None:
        rate["confirmed"] = start.confirmed and end.confirmed
    return rate


# --- CPU per process --------------------------------------------------------------------------

ROLE_ORDER = ("scheduler", "detokenizer", "api")


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the third (state) on; the name before them may hold
    spaces and parentheses, so the split is after its last ")"."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process: /proc/PID/stat counts all its threads."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15, in clock ticks


def client_cpu_seconds() -> float:
    """This benchmark client's own CPU (user + system, all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def name_processes(roles: dict[int, str | None]) -> dict[str, int]:
    """{name: pid} of the processes with a tokenpipe role, in ``ROLE_ORDER``. A role held by
    several processes (``--api-workers N``: N API processes) names them role-0, role-1, ...
    in the order they started (their start time in /proc/PID/stat, then pid), which is the
    order the supervisor spawned them; a role held by one is its plain name."""
    held: dict[str, list[tuple[int, int]]] = {}
    for pid, role in roles.items():
        if role is None:
            continue
        try:
            started = int(stat_fields(pid)[19])  # field 22
        except (OSError, ValueError, IndexError):
            continue  # gone already
        held.setdefault(role, []).append((started, pid))
    names: dict[str, int] = {}
    for role in sorted(held, key=lambda r: (ROLE_ORDER.index(r) if r in ROLE_ORDER else len(ROLE_ORDER), r)):
        ordered = sorted(held[role])
        for i, (_, pid) in enumerate(ordered):
            names[role if len(ordered) == 1 else f"{role}-{i}"] = pid
    return names


def server_processes(supervisor_pid: int) -> dict[str, int]:
    """The processes of a ``tokenpipe serve`` supervisor (its children), by name."""
    return name_processes(descendants(supervisor_pid))


def given_processes(pids: Sequence[int]) -> dict[str, int]:
    """``--pids``: a process with tokenpipe children (a ``tokenpipe serve`` supervisor)
    stands for them; any other is named by the role in its command line, or ``pid-N``."""
    roles: dict[int, str | None] = {}
    others: dict[str, int] = {}
    for pid in pids:
        children = {child: role for child, role in descendants(pid).items() if role}
        if children:
            roles.update(children)
            continue
        role = cmdline_role(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))  # a pid not there stops the run
        if role is None:
            others[f"pid-{pid}"] = pid
        else:
            roles[pid] = role
    return {**name_processes(roles), **others}


@dataclass
class CpuReading:
    """CPU-seconds used so far, read at ``at`` (seconds since the run's start)."""

    at: float
    client: float
    procs: dict[str, float]  # by name; a process gone is left out


def read_cpu(procs: dict[str, int], t0: float) -> CpuReading:
    at = time.perf_counter() - t0
    used: dict[str, float] = {}
    for name, pid in procs.items():
        try:
            used[name] = cpu_seconds(pid)
        except (OSError, ValueError, IndexError):
            pass  # exited: left out of this reading, so out of the window's figures
    return CpuReading(at, client_cpu_seconds(), used)


def is_api(name: str) -> bool:
    return name == "api" or name.startswith("api-")


def window_cpu(a: CpuReading, b: CpuReading, procs: dict[str, int], results: Sequence[ReqResult]) -> dict[str, Any]:
    """Each process's CPU-seconds and cores (CPU-s / window-s) between the readings ``a``
    and ``b``, and the output tokens the clients received between them (by each event's
    arrival time) per CPU-second of all the API processes together."""
    span = b.at - a.at
    per = {
        name: {"pid": pid, "cpu_s": b.procs[name] - a.procs[name], "cores": ratio(b.procs[name] - a.procs[name], span)}
        for name, pid in procs.items()
        if name in a.procs and name in b.procs
    }
    tokens = sum(n for r in results for t, n in r.arrivals if a.at <= t <= b.at)
    api = [b.procs[name] - a.procs[name] for name in per if is_api(name)]  # the API processes' cpu_s
    api_cpu = sum(api) if api else None
    client = b.client - a.client
    return {
        "window_s": [a.at, b.at],
        "processes": per,
        "client": {"cpu_s": client, "cores": ratio(client, span)},
        "tokens_in_window": tokens,
        "api_cpu_s": api_cpu,
        # None: no API process measured, or not one clock tick of API CPU in the window.
        "tokens_per_api_cpu_s": ratio(tokens, api_cpu),
        "clock_tick_s": 1.0 / CLK_TCK,
    }


# --- the attached run -------------------------------------------------------------------------


async def run_load(url: str, cfg: LoadConfig, info_url: str | None = None, procs: dict[str, int] | None = None) -> dict[str, Any]:
    """The workload ``cfg`` against ``url``; with ``procs`` (the server's processes by name)
    their CPU over the steady part too (``window_cpu``)."""
    vocab, start = await prepare(url, info_url=info_url)
    rng = random.Random(cfg.seed)
    streams = [rng.random() < cfg.stream_ratio for _ in range(cfg.requests)]
    results: list[ReqResult] = []
    samples: list[Sample] = []
    next_i = 0
    in_flight = 0
    full_at: float | None = None  # every client has a request in flight
    dry_at: float | None = None  # the first client found no work left
    last_sent = 0.0
    cpu_full: CpuReading | None = None  # read when full_at is set, and cpu_dry when dry_at is
    cpu_dry: CpuReading | None = None
    watched = procs or {}
    target = min(cfg.concurrency, cfg.requests)
    limits = httpx.Limits(max_connections=cfg.concurrency + 8, max_keepalive_connections=cfg.concurrency + 8)
    bar = tqdm(total=cfg.requests, file=sys.stderr, disable=not cfg.progress, desc="requests", unit="req")
    stop = asyncio.Event()
    t0 = time.perf_counter()

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal next_i, in_flight, full_at, dry_at, last_sent, cpu_full, cpu_dry
        while next_i < cfg.requests:
            i = next_i
            next_i += 1
            in_flight += 1
            last_sent = time.perf_counter() - t0
            if full_at is None and in_flight >= target:
                full_at = last_sent
                cpu_full = read_cpu(watched, t0)  # no event is handled in between: one thread
            res = await send_one(client, url, make_body(i, cfg, vocab, streams[i]), t0, api=cfg.api)
            in_flight -= 1
            results.append(res)
            bar.update(1)
        if dry_at is None:
            dry_at = time.perf_counter() - t0
            cpu_dry = read_cpu(watched, t0)

    sampler = asyncio.create_task(sample_loop(url, t0, samples, stop))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(cfg.concurrency)))
    duration = time.perf_counter() - t0
    stop.set()
    await sampler
    bar.close()
    end = None
    if start is not None:
        async with httpx.AsyncClient(timeout=10.0) as client:
            end = await settle(client, url, latest_steps(start, samples, last_sent), SETTLE_TIMEOUT)
    summary = summarize(results, duration)
    lo, hi = full_at or 0.0, dry_at or duration
    rate = run_step_rate(start, samples, end, duration, lo, hi)
    cpu = window_cpu(cpu_full, cpu_dry, watched, results) if cpu_full is not None and cpu_dry is not None else None
    if cpu is not None and procs is None:
        cpu["note"] = "server processes not measured: give --pids (or use --launch)"
    summary.update(
        config=asdict(cfg),
        url=url,
        steady_s=[lo, hi],
        scheduler_steps=rate,
        cpu=cpu,
        samples=[asdict(s) for s in samples],
        requests_detail=[{k: v for k, v in asdict(r).items() if k not in ("itl", "arrivals")} for r in results],
    )
    summary["_results"] = results  # for the plot; dropped before the JSON
    return summary


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)

    def pick(q: float) -> float | None:
        if not ordered:
            return None
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1000.0

    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "mean": sum(ordered) * 1000.0 / len(ordered) if ordered else None}


def summarize(results: Sequence[ReqResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    lost = [r for r in ok if r.completion_tokens is not None and r.completion_tokens != r.tokens]
    logprobs_lost = sum(abs(r.tokens - r.logprobs) for r in ok if r.logprobs is not None)
    tokens = sum(r.tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "requests": len(results),
        "completed": len(ok),
        "streaming": sum(r.stream for r in results),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "errors": len(errors),
        "error_examples": sorted(set(e for e in errors if e))[:5],
        "tokens_lost": sum(abs((r.completion_tokens or 0) - r.tokens) for r in lost),
        "requests_with_lost_tokens": len(lost),
        "logprobs_lost": logprobs_lost,
    }


# --- the discarded run ------------------------------------------------------------------------


async def run_discard(url: str, cfg: LoadConfig, window_s: float) -> dict[str, Any]:
    """Keeps ``concurrency`` streaming requests live in a ``--discard-output`` scheduler for
    ``window_s`` after they are first all sent, then aborts everything.

    The clients never get an answer, so the top-up reads the scheduler's ``live_reqs``. A
    stream's headers come back once the server has handed the request to the scheduler, so
    every request acknowledged before the poll that preceded a new report is counted in that
    report, or finished (allowing two scheduler steps for the request to be taken in).
    Requests sent later are assumed live. The oldest acknowledged streams that the
    scheduler has finished (they finish in arrival order: same prompt length, same
    max_new_tokens) are closed, so connections do not pile up. The abort waits until
    every request sent has reached the scheduler (or failed): one still on its way would
    run after it."""
    vocab, start = await prepare(url, discarding=True)
    samples: list[Sample] = []
    stop = asyncio.Event()
    t0 = time.perf_counter()
    sampler = asyncio.create_task(sample_loop(url, t0, samples, stop))
    tasks: list[asyncio.Task[ReqResult]] = []
    acked: list[tuple[float, asyncio.Task[ReqResult]]] = []  # in acknowledgement order
    closed = 0
    last_sent = 0.0
    seen: Sample | None = None  # the sample that first showed the latest report
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:

        def send(n: int) -> None:
            nonlocal last_sent
            for _ in range(n):
                last_sent = time.perf_counter() - t0
                i = len(tasks)
                body = make_body(i, cfg, vocab, True)

                def on_headers(i: int = i) -> None:
                    acked.append((time.perf_counter() - t0, tasks[i]))

                tasks.append(asyncio.create_task(send_one(client, url, body, t0, on_headers)))

        send(cfg.concurrency)
        full_at = time.perf_counter() - t0
        while time.perf_counter() - t0 < full_at + window_s:
            await asyncio.sleep(POLL_INTERVAL / 2)
            if len(samples) < 2 or (seen is not None and samples[-1].steps == seen.steps):
                continue
            # The scheduler takes in new requests between steps, so one that arrived during
            # the step before the report is not in it yet: allow two steps, plus transit.
            step_s = (samples[-1].answered - seen.answered) / (samples[-1].steps - seen.steps) if seen is not None else 0.5
            seen = samples[-1]
            cut = samples[-2].asked - 0.02 - min(1.0, 2 * step_s)
            counted = bisect.bisect_left([t for t, _ in acked], cut)
            live = samples[-1].live
            while closed < counted - live:
                acked[closed][1].cancel()
                closed += 1
            send(max(0, cfg.concurrency - live - (len(tasks) - counted)))
        deadline = time.perf_counter() + SETTLE_TIMEOUT
        while time.perf_counter() < deadline and any(not t.done() for t in set(tasks) - {t for _, t in acked}):
            await asyncio.sleep(POLL_INTERVAL / 2)  # (one done before its acknowledgement failed)
        async with httpx.AsyncClient(timeout=10.0) as ctl:
            await ctl.post(f"{url}/abort_request", json={"abort_all": True})
            end_t = time.perf_counter() - t0
            stop.set()
            await sampler
            end = await settle(ctl, url, latest_steps(start, samples, last_sent), SETTLE_TIMEOUT) if start is not None else None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    rate = run_step_rate(start, samples, end, end_t, full_at, full_at + window_s)
    return {"requests_sent": len(tasks), "window_s": window_s, "scheduler_steps": rate, "samples": [asdict(s) for s in samples]}


# --- greedy against sampled ------------------------------------------------------------------


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``; None when either is missing or ``den`` is not positive."""
    return num / den if num is not None and den is not None and den > 0 else None


def sampling_variants(cfg: LoadConfig, temperature: float | None, top_p: float | None, seeded: bool | None) -> dict[str, LoadConfig]:
    """The workload of ``cfg`` greedy and sampled; the sampled one takes ``SAMPLED_*`` for
    each parameter not given (None)."""
    return {
        "greedy": replace(cfg, temperature=0.0, top_p=None, seeded=False),
        "sampled": replace(
            cfg,
            temperature=SAMPLED_TEMPERATURE if temperature is None else temperature,
            top_p=SAMPLED_TOP_P if top_p is None else top_p,
            seeded=SAMPLED_SEEDED if seeded is None else seeded,
        ),
    }


BRIEF_KEYS: tuple[str, ...] = ("requests", "completed", "duration_s", "requests_per_s", "output_tokens", "output_tokens_per_s")
BRIEF_KEYS += ("ttft_ms", "itl_ms", "errors", "error_examples", "tokens_lost", "logprobs_lost", "scheduler_steps", "cpu")


def brief(run: dict[str, Any]) -> dict[str, Any]:
    """A run's summary without its per-request and per-sample detail."""
    return {k: run[k] for k in BRIEF_KEYS}


@dataclass(frozen=True)
class Arm:
    """One side of a comparison: a workload, the server it runs on and that server's
    processes by name (None: not measured)."""

    cfg: LoadConfig
    url: str
    procs: dict[str, int] | None = None


def same_server(variants: dict[str, LoadConfig], url: str, procs: dict[str, int] | None) -> dict[str, Arm]:
    return {name: Arm(cfg, url, procs) for name, cfg in variants.items()}


async def run_rounds(arms: dict[str, Arm], rounds: int, prompt_set: int) -> dict[str, Any]:
    """``rounds`` rounds, each one run of each of the two ``arms`` (the base one first, then
    the one compared with it), the order swapped from round to round; every run has prompts
    of its own (``prompt_set`` on). Output tokens/s of each (``<name>_output_tokens_per_s``)
    and the ratio compared/base are medians over rounds."""
    base, other = arms
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        order = (base, other) if r % 2 == 0 else (other, base)
        row: dict[str, Any] = {"first": order[0]}
        for name in order:
            arm = arms[name]
            row[name] = brief(await run_load(arm.url, replace(arm.cfg, prompt_set=prompt_set), procs=arm.procs))
            prompt_set += 1
        row["ratio"] = ratio(row[other]["output_tokens_per_s"], row[base]["output_tokens_per_s"])
        runs.append(row)
    ratios = [row["ratio"] for row in runs]
    return {
        "rounds": runs,
        **{f"{name}_output_tokens_per_s": statistics.median([row[name]["output_tokens_per_s"] for row in runs]) for name in arms},
        "ratio": statistics.median(ratios) if None not in ratios else None,
        "errors": sum(row[name]["errors"] for row in runs for name in arms),
        "tokens_lost": sum(row[name]["tokens_lost"] for row in runs for name in arms),
        "logprobs_lost": sum(row[name]["logprobs_lost"] for row in runs for name in arms),
    }


async def run_sampling(url: str, variants: dict[str, LoadConfig], rounds: int, procs: dict[str, int] | None = None) -> dict[str, Any]:
    """Greedy against sampled (``sampling_variants``), in ``run_rounds``."""
    result = await run_rounds(same_server(variants, url, procs), rounds, prompt_set=1)  # the main run had set 0
    params = {name: {k: getattr(v, k) for k in ("temperature", "top_p", "seeded")} for name, v in variants.items()}
    return {"params": params, **result}


def logprobs_variants(cfg: LoadConfig, top_logprobs: int) -> dict[str, LoadConfig]:
    """The workload of ``cfg`` without logprobs, and with ``top_logprobs`` on every request."""
    return {"without": replace(cfg, top_logprobs=None), "logprobs": replace(cfg, top_logprobs=top_logprobs)}


async def run_logprobs(
    url: str, cfg: LoadConfig, top_logprobs: int, rounds: int, prompt_set: int, procs: dict[str, int] | None = None
) -> dict[str, Any]:
    """Without logprobs against with top ``top_logprobs`` on every request, in ``run_rounds``."""
    result = await run_rounds(same_server(logprobs_variants(cfg, top_logprobs), url, procs), rounds, prompt_set)
    return {"top_logprobs": top_logprobs, **result}


# --- one API process against N ---------------------------------------------------------------

# The arms of --compare-api-workers: the main server (one API process) and one with N.
SINGLE, MULTI = "single", "multi"


def api_workers_flags(workers: int) -> list[str]:
    """The extra ``tokenpipe serve`` flags of the N-worker server. With N = 1 none: one API
    process is the default, and a server without the flag can run this comparison (two
    alike servers) to check the machinery."""
    return ["--api-workers", str(workers)] if workers > 1 else []


def median_cpu(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per process, the median over ``runs`` of its cores in each run's steady window, and
    the median of the runs' tokens per API CPU-second."""
    cpus = [run["cpu"] for run in runs if run.get("cpu")]
    names = [name for name in (cpus[0]["processes"] if cpus else {}) if all(name in c["processes"] for c in cpus)]
    cores = {name: [c["processes"][name]["cores"] for c in cpus] for name in names}
    per_token = [c["tokens_per_api_cpu_s"] for c in cpus]
    client = [c["client"]["cores"] for c in cpus]
    return {
        "cores": {name: statistics.median(v) if None not in v else None for name, v in cores.items()},
        "client_cores": statistics.median(client) if cpus and None not in client else None,
        "tokens_per_api_cpu_s": statistics.median(per_token) if cpus and None not in per_token else None,
    }


async def run_api_workers(arms: dict[str, Arm], workers: int, rounds: int, prompt_set: int) -> dict[str, Any]:
    """The same workload on the one-API-process server and the ``workers`` one, in
    ``run_rounds``, with each arm's per-process CPU (``median_cpu``)."""
    result = await run_rounds(arms, rounds, prompt_set)
    cpu = {name: median_cpu([row[name] for row in result["rounds"]]) for name in arms}
    return {"workers": workers, "flags": api_workers_flags(workers), **result, "cpu": cpu}


# --- launching servers ------------------------------------------------------------------------


# --- output -----------------------------------------------------------------------------------


def fmt_pcts(p: dict[str, float | None]) -> str:
    return "  ".join(f"{k} {v:9.1f}" if v is not None else f"{k}       n/a" for k, v in p.items() if k != "mean")


def fmt_rate(label: str, rate: dict[str, Any] | None, extra: str = "") -> str:
    if not rate:
        return f"  {label:<20}{'n/a':>10}   (no scheduler reports)"
    lo, hi = rate["window_s"]
    line = f"  {label:<20}{rate['steps_per_s']:10.2f}   ({rate['steps']} steps, {lo:.1f}-{hi:.1f} s{extra})"
    if not rate.get("confirmed", True):
        line += f"  [no report of the work done within {SETTLE_TIMEOUT:g} s: may miss the last steps]"
    return line


def fmt_target(label: str, value: float | None, target: float, c: dict[str, Any]) -> str:
    """A ratio against its target, set at ``TARGET_STREAMS`` streaming clients."""
    if value is None:
        return f"  {label:<20}{'n/a':>10}"
    verdict = "PASS" if value >= target else "MISS"
    note = "" if c["concurrency"] == TARGET_STREAMS and c["stream_ratio"] == 1.0 else f"; target is set at {TARGET_STREAMS} streams"
    return f"  {label:<20}{value:10.3f}x  target >= {target}x: {verdict}{note}"


def fmt_params(p: dict[str, Any]) -> str:
    if p["temperature"] == 0.0:
        return "temperature 0"
    return f"temperature {p['temperature']:g}" + (f", top_p {p['top_p']:g}" if p["top_p"] is not None else "") + (", seeded" if p["seeded"] else "")


def fmt_rounds(
    s: dict[str, Any], c: dict[str, Any], title: str, base: str, other: str, target: float | None, where: str = "same server"
) -> list[str]:
    """A ``run_rounds`` result: each round's output tokens/s and ratio, then the medians;
    the ratio against its target, if it has one."""
    label = f"{other}/{base}"
    w = max(16, len(label) + 2)
    lines = [
        f"  {title}, {where}, {len(s['rounds'])} rounds (order swapped each round)",
        f"  {'round':<8}{'first':<10}{base + ' tok/s':>14}{other + ' tok/s':>15}{label:>{w}}",
    ]
    for i, row in enumerate(s["rounds"], 1):
        value = f"{row['ratio']:{w - 1}.3f}x" if row["ratio"] is not None else f"{'n/a':>{w}}"
        lines.append(
            f"  {i:<8d}{row['first']:<10}{row[base]['output_tokens_per_s']:14.1f}{row[other]['output_tokens_per_s']:15.1f}{value}"
        )
    value = f"{s['ratio']:{w - 1}.3f}x" if s["ratio"] is not None else f"{'n/a':>{w}}"
    lines.append(f"  {'median':<18}{s[base + '_output_tokens_per_s']:14.1f}{s[other + '_output_tokens_per_s']:15.1f}{value}")
    lost = f", logprobs lost {s['logprobs_lost']}" if s["logprobs_lost"] else ""
    lines.append(f"  errors {s['errors']}, tokens lost {s['tokens_lost']}{lost} over the comparison's runs")
    if target is not None:
        lines.append(fmt_target(label, s["ratio"], target, c))
    return lines


def fmt_num(value: float | None, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'n/a':>{width}}"


def fmt_cpu(cpu: dict[str, Any] | None) -> list[str]:
    """Each process's CPU over the steady window, the client's, and tokens per API CPU-s."""
    if cpu is None:
        return [f"  {'CPU':<20}{'n/a':>10}   (no steady window)"]
    lo, hi = cpu["window_s"]
    lines = [f"  CPU, steady window  {'CPU-s':>10}{'cores':>10}   ({lo:.1f}-{hi:.1f} s; cores = CPU-s / {hi - lo:.1f} s)"]
    for name, p in cpu["processes"].items():
        lines.append(f"    {name:<18}{p['cpu_s']:10.2f}{fmt_num(p['cores'], 10, 3)}   (pid {p['pid']})")
    lines.append(f"    {'bench client':<18}{cpu['client']['cpu_s']:10.2f}{fmt_num(cpu['client']['cores'], 10, 3)}")
    if "note" in cpu:
        lines.append(f"    {cpu['note']}")
    api = f"{cpu['api_cpu_s']:.2f}" if cpu["api_cpu_s"] is not None else "n/a"
    lines.append(
        f"  {'tokens/API CPU-s':<20}{fmt_num(cpu['tokens_per_api_cpu_s'], 10, 1)}   "
        f"({cpu['tokens_in_window']} output tokens received in the window / {api} API CPU-s)"
    )
    return lines


def fmt_api_workers(s: dict[str, Any], c: dict[str, Any]) -> list[str]:
    n = s["workers"]
    flags = f"plus {' '.join(s['flags'])}" if s["flags"] else "(N = 1: no --api-workers flag, one API process as the default)"
    title = f"one API process against {n}: {SINGLE} = the main server; {MULTI} = a second one, the same flags {flags}"
    lines = fmt_rounds(s, c, title, SINGLE, MULTI, None, where="two servers up at once")
    for name in (SINGLE, MULTI):
        m = s["cpu"][name]
        api = "  ".join(f"{k} {fmt_num(v, 0, 3)}" for k, v in m["cores"].items() if is_api(k)) or "n/a"
        lines.append(
            f"  {name:<8}API cores: {api}; tokens/API CPU-s {fmt_num(m['tokens_per_api_cpu_s'], 0, 1)} "
            f"(medians over rounds; " + ", ".join(f"{k} {fmt_num(v, 0, 3)}" for k, v in m["cores"].items() if not is_api(k))
            + f", client {fmt_num(m['client_cores'], 0, 3)} cores)"
        )
    return lines


def fmt_sampling(s: dict[str, Any], c: dict[str, Any]) -> list[str]:
    title = f"greedy against sampled: greedy = {fmt_params(s['params']['greedy'])}; sampled = {fmt_params(s['params']['sampled'])}"
    return fmt_rounds(s, c, title, "greedy", "sampled", TARGET_SAMPLING_RATIO)


def fmt_logprobs(s: dict[str, Any], c: dict[str, Any]) -> list[str]:
    title = f"without logprobs against top-{s['top_logprobs']} logprobs on every request"
    return fmt_rounds(s, c, title, "without", "logprobs", TARGET_LOGPROBS_RATIO)


def format_report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"bench/serve  {r['url']}  concurrency {c['concurrency']}, {r['requests']} requests ({r['streaming']} streaming), "
        f"prompt {c['prompt_len']}, max_new_tokens {c['max_new_tokens']}, {fmt_params(c)}"
        + (f", through {ENDPOINTS[c['api']]}" if c["api"] != "generate" else ""),
        f"  duration            {r['duration_s']:10.2f} s",
        f"  requests/s          {r['requests_per_s']:10.2f}",
        f"  output tokens/s     {r['output_tokens_per_s']:10.1f}",
        f"  TTFT ms             {fmt_pcts(r['ttft_ms'])}",
        f"  ITL ms              {fmt_pcts(r['itl_ms'])}",
        f"  e2e ms              {fmt_pcts(r['e2e_ms'])}",
        f"  errors              {r['errors']:10d}" + (f"   e.g. {r['error_examples'][0]}" if r["error_examples"] else ""),
        f"  tokens lost         {r['tokens_lost']:10d}   ({r['requests_with_lost_tokens']} requests)",
    ]
    lines.append(fmt_rate("scheduler steps/s", r.get("scheduler_steps")))
    lines += fmt_cpu(r.get("cpu"))
    d = r.get("discard")
    if d is not None:
        lines.append(fmt_rate("discarded steps/s", d["scheduler_steps"], f", {d['requests_sent']} requests sent"))
        lines.append(fmt_target("attached/discarded", r.get("steps_ratio"), TARGET_RATIO, c))
    s = r.get("sampling")
    if s is not None:
        lines += fmt_sampling(s, c)
    lp = r.get("logprobs")
    if lp is not None:
        lines += fmt_logprobs(lp, c)
    w = r.get("api_workers")
    if w is not None:
        lines += fmt_api_workers(w, c)
    return "\n".join(lines)


def write_plot(path: Path, r: dict[str, Any], results: Sequence[ReqResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ttft = [[x.ttft * 1000 for x in results if x.ok and x.ttft is not None and x.stream == st] for st in (True, False)]
    itl = [v * 1000 for x in results if x.ok for v in x.itl]
    axes[0].hist(ttft, bins=40, stacked=True, label=["streaming", "non-streaming (= e2e)"])
    axes[0].set(title="TTFT", xlabel="ms", ylabel="requests")
    axes[0].legend()
    axes[1].hist(itl or [0.0], bins=60)
    axes[1].set(title="ITL (streaming)", xlabel="ms per token", ylabel="events")
    bin_s = max(1.0, r["duration_s"] / 60)
    nbins = int(r["duration_s"] / bin_s) + 1
    per_bin = [0] * nbins
    for x in results:
        for t, n in x.arrivals:
            per_bin[min(nbins - 1, int(t / bin_s))] += n
    axes[2].plot([i * bin_s for i in range(nbins)], [n / bin_s for n in per_bin], drawstyle="steps-post", label="client tokens/s")
    times, rates = step_rates(r.get("samples") or [])
    if rates:
        ax2 = axes[2].twinx()
        ax2.plot(times, rates, color="tab:orange", alpha=0.7)
        ax2.set_ylabel("scheduler steps/s (orange)")
    axes[2].set(title="output tokens/s over time", xlabel="s", ylabel="tokens/s")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=80)
    plt.close(fig)


def step_rates(samples: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Steps/s between consecutive new scheduler reports, at the time each was first seen."""
    changes = [b for a, b in zip(samples, samples[1:]) if b["steps"] != a["steps"]]
    pairs = [(b["answered"], (b["steps"] - a["steps"]) / (b["answered"] - a["answered"])) for a, b in zip(changes, changes[1:])]
    return [t for t, _ in pairs], [v for _, v in pairs]


# --- main -------------------------------------------------------------------------------------


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """On uvloop, as the server runs: the client shares the machine with the server, and the
    default loop costs it noticeably more CPU per streamed event."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:30000", help="a running server (default %(default)s)")
    where.add_argument("--launch", action="store_true", help="start `tokenpipe serve` on a free port and stop it at the end")
    p.add_argument("--server-args", default="", help="extra `tokenpipe serve` flags for --launch, as one string")
    p.add_argument(
        "--info-url", default=None, help="when --url is a router: a server behind it, for the vocabulary size (no step rate is measured then)"
    )
    p.add_argument(
        "--pids",
        default=None,
        metavar="PID[,PID...]",
        help="with --url: the server's processes whose CPU to measure (a `tokenpipe serve` supervisor's pid stands for its children)",
    )
    p.add_argument(
        "--api",
        choices=sorted(ENDPOINTS),
        default="generate",
        help="generate: SGLang's /generate (default); completions: /v1/completions with token-id prompts and usage on every chunk",
    )
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=None, help="total requests (default 4 x concurrency)")
    p.add_argument("--stream-ratio", type=float, default=0.5, help="fraction of streaming requests (default 0.5)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"default {DEFAULT_TEMPERATURE} ({SAMPLED_TEMPERATURE} for --compare-sampling's sampled runs)",
    )
    p.add_argument("--top-p", type=float, default=None, help=f"default: not sent ({SAMPLED_TOP_P} for --compare-sampling's sampled runs)")
    p.add_argument(
        "--seeded",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a distinct seed per request, --seed plus its index (default on)",
    )
    p.add_argument("--compare-discard", action="store_true", help="with --launch: also measure a --discard-output server")
    p.add_argument(
        "--compare-sampling",
        action="store_true",
        help="with --launch: also run the workload greedy and sampled on the same server, in alternating rounds",
    )
    p.add_argument(
        "--top-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="with --launch: also run the workload without and with top-K logprobs on every request, in alternating rounds",
    )
    p.add_argument(
        "--compare-api-workers",
        type=int,
        default=None,
        metavar="N",
        help="with --launch: also run the workload on the main server and on one with --api-workers N (both up at once), in alternating rounds",
    )
    p.add_argument(
        "--rounds",
        "--sampling-rounds",
        type=int,
        default=2,
        help="rounds of --compare-sampling, --top-logprobs and --compare-api-workers (default 2, at least 2)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH.png")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.compare_discard and not args.launch:
        p.error("--compare-discard needs --launch")
    if args.compare_sampling and not args.launch:
        p.error("--compare-sampling needs --launch")
    if args.compare_sampling and args.temperature == 0.0:
        p.error("--compare-sampling compares with sampled runs: --temperature must be > 0")
    if args.top_logprobs is not None and not args.launch:
        p.error("--top-logprobs needs --launch")
    if args.top_logprobs is not None and not 0 <= args.top_logprobs <= MAX_TOP_LOGPROBS:
        p.error(f"--top-logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    if args.pids is not None and args.launch:
        p.error("--pids is for --url: --launch knows its server's processes")
    if args.pids is not None:
        try:
            args.pids = [int(x) for x in args.pids.split(",") if x.strip()]
        except ValueError:
            p.error("--pids takes comma-separated process ids")
    if args.api == "completions" and args.top_logprobs is not None:
        p.error("--top-logprobs measures /generate's logprobs: use --api generate")
    if args.api == "completions" and args.compare_discard:
        # /v1/completions answers a stream's headers after its first output, which a
        # discarding server never sends: the top-up could not count requests taken in.
        p.error("--compare-discard drives /generate: use --api generate")
    if args.compare_api_workers is not None:
        if not args.launch:
            p.error("--compare-api-workers needs --launch")
        if args.compare_api_workers < 1:
            p.error("--compare-api-workers must be >= 1")
        if "--api-workers" in shlex.split(args.server_args):
            p.error("--compare-api-workers runs the main server with one API process: leave --api-workers out of --server-args")
    if args.rounds < 2:
        p.error("--rounds must be >= 2")
    if args.temperature is not None and args.temperature < 0.0:
        p.error("--temperature must be >= 0")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        p.error("--top-p must be in (0, 1]")
    if args.info_url is not None and args.launch:
        p.error("--info-url is for --url (a router); --launch starts a server of its own")
    if args.concurrency < 1 or not 0.0 <= args.stream_ratio <= 1.0:
        p.error("--concurrency must be >= 1 and --stream-ratio in [0, 1]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = LoadConfig(
        concurrency=args.concurrency,
        requests=args.requests if args.requests is not None else 4 * args.concurrency,
        stream_ratio=args.stream_ratio,
        max_new_tokens=args.max_new_tokens,
        prompt_len=args.prompt_len,
        seed=args.seed,
        progress=not args.no_progress,
        temperature=args.temperature if args.temperature is not None else DEFAULT_TEMPERATURE,
        top_p=args.top_p,
        seeded=args.seeded if args.seeded is not None else True,
        api=args.api,
    )
    server_args = shlex.split(args.server_args)
    launched = LaunchedServer(["--log-level", "warning", *server_args]) if args.launch else contextlib.nullcontext(None)
    with launched as server:
        url = server.url if server is not None else args.url
        procs = server_processes(server.proc.pid) if server is not None else given_processes(args.pids) if args.pids else None
        report = run_async(run_load(url, cfg, args.info_url, procs))
        next_set = 1  # every run has prompts of its own: the main run had set 0
        if args.compare_sampling:
            variants = sampling_variants(cfg, args.temperature, args.top_p, args.seeded)
            report["sampling"] = run_async(run_sampling(url, variants, args.rounds, procs))
            next_set += 2 * args.rounds
        if args.top_logprobs is not None:
            report["logprobs"] = run_async(run_logprobs(url, cfg, args.top_logprobs, args.rounds, next_set, procs))
            next_set += 2 * args.rounds
        if args.compare_api_workers is not None:
            flags = api_workers_flags(args.compare_api_workers)
            # Both servers stay up, on their own ports, so the rounds alternate without a
            # restart; the idle one waits on its sockets meanwhile.
            with LaunchedServer(["--log-level", "warning", *server_args, *flags]) as multi:
                arms = {SINGLE: Arm(cfg, url, procs), MULTI: Arm(cfg, multi.url, server_processes(multi.proc.pid))}
                report["api_workers"] = run_async(run_api_workers(arms, args.compare_api_workers, args.rounds, next_set))
    if args.compare_discard:
        lo, hi = report["steady_s"]
        with LaunchedServer(["--log-level", "warning", *server_args, "--discard-output", "--graceful-timeout", "1"]) as discard:
            report["discard"] = run_async(run_discard(discard.url, cfg, max(2.0, hi - lo)))
        a, d = report.get("scheduler_steps"), report["discard"]["scheduler_steps"]
        report["steps_ratio"] = ratio(a["steps_per_s"] if a else None, d["steps_per_s"] if d else None)
    results: list[ReqResult] = report.pop("_results")
    print(format_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        write_plot(args.plot, report, results)
    runs = [report, *(report[k] for k in ("sampling", "logprobs", "api_workers") if k in report)]
    ok = all(run["errors"] == 0 and run["tokens_lost"] == 0 and run["logprobs_lost"] == 0 for run in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
