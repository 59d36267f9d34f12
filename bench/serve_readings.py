"""Readings of a bench/serve.py run from the server's side: the scheduler's step rate and
each process's CPU, both over the steady part of the run (every client has a request in
flight, until the first client runs out of work).

CPU-seconds are much steadier than wall-clock rates on a shared machine: each server
process's utime + stime (/proc/PID/stat, all threads) and the client's own (getrusage) are
read at the two ends of the steady window; the report gives each one's cores and **tokens
per API CPU-second**. The step rate comes from the cumulative
``scheduler.forward_steps_total`` in ``/server_info`` (the scheduler reports about every
0.5 s while it works): a reading before the run, one at each new report and one after the
run give the steps between any two moments. Details: bench/README.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.launch import cmdline_role, descendants
from bench.serve_client import ReqResult

POLL_INTERVAL = 0.1  # /server_info sampling; the scheduler reports about every 0.5 s
SETTLE_TIMEOUT = 5.0  # for the report the scheduler sends once a run's work is done
PEER_WARM_UP = {"prompt": [16, 17, 18, 19], "max_tokens": 4, "ignore_eos": True}
CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc/PID/stat's CPU times are in these ticks


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


# --- step rate --------------------------------------------------------------------------------


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
    return Sample(
        asked, time.perf_counter() - t0, int(sched["forward_steps_total"]), int(sched["live_reqs"])
    )


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


async def settle(
    client: httpx.AsyncClient, url: str, older_steps: int, timeout: float
) -> Settled | None:
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


def phase_readings(
    start: Settled, samples: Sequence[Sample], end: Settled, end_t: float
) -> list[tuple[float, int]]:
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


def checkpoint_vocab(model_dir: Path) -> int:
    """The vocabulary size in a checkpoint's config.json: a peer server's (vLLM has no
    /server_info), for the prompts' token ids."""
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


async def prepare(
    url: str, discarding: bool = False, info_url: str | None = None, vocab: int | None = None
) -> tuple[int, Settled | None]:
    """The vocabulary size, from the ``/server_info`` of ``info_url`` (a server behind the
    router at ``url``: a router has none of its own) or else of ``url``; and the scheduler's
    step count (None: ``url`` has no scheduler reports, as a router) after one short
    request, so the model's first (slow) forward is not timed. A discarding server never
    answers that request: its report says when it is done. ``vocab`` given: ``url`` is a
    peer server (vLLM) with no /server_info: the vocabulary is that, the short request goes
    to /v1/completions, and no step count is read."""
    async with httpx.AsyncClient(timeout=120.0) as client:
        if vocab is not None:
            (await client.post(f"{url}/v1/completions", json=PEER_WARM_UP)).raise_for_status()
            return vocab, None
        resp = await client.get(f"{info_url or url}/server_info")
        resp.raise_for_status()
        info = resp.json()
        vocab = int(info["vocab_size"])
        reports = info_url is None and "scheduler" in info
        older = (
            int(info["scheduler"]["forward_steps_total"]) if reports and info["scheduler"] else 0
        )
        warm = {
            "input_ids": [16, 17, 18, 19],
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        }
        if not discarding:
            (await client.post(f"{url}/generate", json=warm)).raise_for_status()
            return vocab, await settle(client, url, older, SETTLE_TIMEOUT) if reports else None
        task = asyncio.create_task(client.post(f"{url}/generate", json=warm))
        start = await settle(client, url, older, 120.0)  # it includes the first forward
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return vocab, start


def run_step_rate(
    start: Settled | None,
    samples: Sequence[Sample],
    end: Settled | None,
    end_t: float,
    lo: float,
    hi: float,
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
    for role in sorted(
        held, key=lambda r: (ROLE_ORDER.index(r) if r in ROLE_ORDER else len(ROLE_ORDER), r)
    ):
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
        role = cmdline_role(
            Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        )  # a pid not there stops the run
        if role is None:
            others[f"pid-{pid}"] = pid
        else:
            roles[pid] = role
    return {**name_processes(roles), **others}


def process_tree(root: int) -> list[int]:
    """``root`` and every live process under it (children, their children...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int(stat_fields(int(entry.name))[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def process_title(args: Sequence[bytes]) -> str:
    """A name for a process that is not tokenpipe's, from its argv: the title it gave itself
    (vLLM's ``VLLM::EngineCore`` reads ``vllm-enginecore``), else its program's name."""
    first = args[0].decode(errors="replace") if args and args[0] else "process"
    if "::" in first:
        return first.lower().replace("::", "-").split()[0]
    return Path(first).name


def tree_processes(root: int, root_name: str) -> dict[str, int]:
    """Every process of a server, by name, for a reading of its whole CPU: ``root`` as
    ``root_name``, tokenpipe's processes by role (as ``name_processes``), any other by its
    ``process_title``; a name held twice is numbered (``python-1``)."""
    roles: dict[int, str | None] = {}
    titles: dict[int, str] = {}
    for pid in process_tree(root)[1:]:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if not args[0]:  # a process caught mid-exec reads empty: its command name then
                args = [Path(f"/proc/{pid}/comm").read_bytes().strip()]
        except OSError:
            continue
        role = cmdline_role(args)
        if role is None:
            titles[pid] = process_title(args)
        else:
            roles[pid] = role
    names = {root_name: root, **name_processes(roles)}
    for pid, title in sorted(titles.items()):
        name, n = title, 0
        while name in names:
            n += 1
            name = f"{title}-{n}"
        names[name] = pid
    return names


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


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``; None when either is missing or ``den`` is not positive."""
    return num / den if num is not None and den is not None and den > 0 else None


def is_api(name: str) -> bool:
    return name == "api" or name.startswith("api-")


def window_cpu(
    a: CpuReading, b: CpuReading, procs: dict[str, int], results: Sequence[ReqResult]
) -> dict[str, Any]:
    """Each process's CPU-seconds and cores (CPU-s / window-s) between the readings ``a``
    and ``b``, and the output tokens the clients received between them (by each event's
    arrival time) per CPU-second of all the API processes together."""
    span = b.at - a.at
    per = {
        name: {
            "pid": pid,
            "cpu_s": b.procs[name] - a.procs[name],
            "cores": ratio(b.procs[name] - a.procs[name], span),
        }
        for name, pid in procs.items()
        if name in a.procs and name in b.procs
    }
    tokens = sum(n for r in results for t, n in r.arrivals if a.at <= t <= b.at)
    api = [
        b.procs[name] - a.procs[name] for name in per if is_api(name)
    ]  # the API processes' cpu_s
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
