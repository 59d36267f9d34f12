"""The scheduler's torch intra-op thread count (``ThreadBudget``). ``--torch-threads N`` pins
it; otherwise it follows the cores that the rest of the machine (the API and detokenizer
processes, a client, other tenants) leaves idle: at most every ``READ_INTERVAL`` seconds, the
busy time of the CPUs this process may run on (/proc/stat) less this process's own CPU time
says how many cores the others kept busy. An OpenMP region waits at its barrier for its
slowest thread, so one thread on a core the others need slows every op below what one thread
fewer would do: the count backs off at the first reading that says so, and grows only on a
second of quiet readings (``GROW_READINGS``), so a lull between bursts does not hand the
others' core to the forward. Under ``--enable-deterministic-inference`` the count is part of the
bits (docs/design/determinism.md): it stays at its start. Reading costs tens of microseconds,
four times a second, between steps, never per step."""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ServerConfig

PROC_STAT = Path("/proc/stat")
READ_INTERVAL = 0.25  # seconds between two readings; each covers the time since the last
GROW_READINGS = 4  # the last readings (a second) a growth is decided on
# How much of a core the others may take from the forward's cores: more than BACK_OFF_SHARE in
# one reading backs off at once; the count grows when the last GROW_READINGS readings took at
# most GROW_SHARE on average and none more than BACK_OFF_SHARE. On 2 cores: 2 threads while the
# others use up to half a core, 1 above that, and 2 again after a second averaging 0.3 at most
# (beside a process busy 30% of a core, 2 threads still beat 1: figures below).
BACK_OFF_SHARE = 0.5
GROW_SHARE = 0.3
# OpenMP's wait policy stays libgomp's default (spin a while at a barrier, then sleep): the
# count, not the policy, keeps a second thread off a busy core. A batch-256 greedy decode step
# on 2 cores, ms, 1 thread / 2 threads / 2 threads with OMP_WAIT_POLICY=PASSIVE, in the
# quietest of 10 alternating rounds (other work shared the machine): idle 6.1-7.3 / 4.3-5.4 /
# 7.0-7.3; beside a process busy 30% of a core 6.2-9.2 / 4.9-6.3 / 6.8-8.3; beside one busy
# all the time 6.2-6.5 / 9.2-9.7 / 7.2-9.5. In the noisy rounds the default's 2 threads went to
# 16-274 ms. PASSIVE never beat 1 thread (a futex wake at each of a step's parallel regions),
# so it would leave the budget nothing to gain; GOMP_SPINCOUNT=10000 was no steadier.

# /proc/stat's per-CPU columns: user nice system idle iowait irq softirq steal (guest time is
# counted in user already). Busy is all but idle and iowait; steal is a core we did not get.
_IDLE, _IOWAIT, _COLUMNS = 3, 4, 8


def busy_seconds(proc_stat: str, cpus: frozenset[int], ticks_per_second: float) -> float:
    """The busy time since boot of the CPUs ``cpus`` (their ``cpuN`` lines in ``proc_stat``,
    the text of /proc/stat), in seconds."""
    ticks = 0
    for line in proc_stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        columns = [int(field) for field in rest.split()[:_COLUMNS]]
        ticks += sum(columns) - columns[_IDLE] - columns[_IOWAIT]
    return ticks / ticks_per_second


@dataclass(frozen=True)
class CpuReading:
    at: float  # the clock's time of the reading (seconds)
    busy: float  # busy seconds of the usable CPUs since boot
    own: float  # this process's CPU seconds, all its threads


class OthersLoad:
    """The cores the rest of the machine kept busy between two readings: the usable CPUs'
    busy time less this process's CPU time, over the time between the readings."""

    def __init__(
        self,
        cpus: frozenset[int],
        read_stat: Callable[[], str] = PROC_STAT.read_text,
        own_cpu: Callable[[], float] = time.process_time,
        ticks_per_second: float = float(os.sysconf("SC_CLK_TCK")),
    ) -> None:
        self._cpus = cpus
        self._read_stat = read_stat
        self._own_cpu = own_cpu
        self._ticks_per_second = ticks_per_second
        self._last: CpuReading | None = None

    @property
    def cores(self) -> int:
        return len(self._cpus)

    def read(self, now: float) -> float | None:
        """Cores (0.0 to the number of usable CPUs) the others used since the previous call;
        None for the first call, which only takes the baseline."""
        busy = busy_seconds(self._read_stat(), self._cpus, self._ticks_per_second)
        reading = CpuReading(now, busy, self._own_cpu())
        last, self._last = self._last, reading
        if last is None or now <= last.at:
            return None
        others = (reading.busy - last.busy) - (reading.own - last.own)
        return min(float(self.cores), max(0.0, others / (now - last.at)))


class ThreadBudget:
    """The thread count (``count``), between ``lowest`` and ``highest``; a range of one value
    is pinned and measures nothing. ``update(now)``, between steps, takes a reading when one
    is due and calls ``apply`` with the count whenever it changes (and once at the start)."""

    def __init__(
        self,
        apply: Callable[[int], None],
        load: OthersLoad,
        *,
        lowest: int,
        highest: int,
        start: int | None = None,
    ) -> None:
        self._apply = apply
        self._load = load
        self.lowest, self.highest = lowest, highest
        self.count = lowest if start is None else min(highest, max(lowest, start))
        self._next_read = 0.0
        # The others' load in the readings since the count last changed, the latest last.
        self._recent: deque[float] = deque(maxlen=GROW_READINGS)
        apply(self.count)

    @property
    def pinned(self) -> bool:
        return self.lowest == self.highest

    def update(self, now: float) -> None:
        if self.pinned or now < self._next_read:
            return
        self._next_read = now + READ_INTERVAL
        try:
            others = self._load.read(now)
        except (OSError, ValueError):  # no readable /proc/stat: the count stays as it is
            self.lowest = self.highest = self.count
            return
        if others is not None:
            self._set(self.decide(others))

    def decide(self, others: float) -> int:
        """The count after a reading of ``others`` busy cores: down at once when they would
        take over ``BACK_OFF_SHARE`` of a core from the forward's cores; up once the last
        ``GROW_READINGS`` readings leave room for more threads, on average with
        ``GROW_SHARE`` and each with ``BACK_OFF_SHARE`` (so it does not grow into a count
        that one of them would have backed off from)."""
        fewer = self._fitting(others, BACK_OFF_SHARE)
        if fewer < self.count:
            self._recent.clear()
            return fewer
        self._recent.append(others)
        if len(self._recent) < GROW_READINGS:
            return self.count
        on_average = self._fitting(sum(self._recent) / len(self._recent), GROW_SHARE)
        more = min(on_average, self._fitting(max(self._recent), BACK_OFF_SHARE))
        if more > self.count:
            self._recent.clear()
            return more
        return self.count

    def _fitting(self, others: float, share: float) -> int:
        """The most threads (within the range) whose cores the others, running on the cores
        the threads leave them first, use at most ``share`` of a core of."""
        fits = math.floor(self._load.cores - others + share)
        return min(self.highest, max(self.lowest, fits))

    def _set(self, count: int) -> None:
        if count != self.count:
            self.count = count
            self._apply(count)


def thread_budget(config: ServerConfig, apply: Callable[[int], None]) -> ThreadBudget:
    """``--torch-threads N``: N, pinned. Otherwise from 1 to the CPUs this process may run on,
    starting at all but two (the fixed count it replaces) until the readings say otherwise;
    pinned there under ``--enable-deterministic-inference``."""
    load = OthersLoad(frozenset(os.sched_getaffinity(0)))
    if config.torch_threads is not None:
        pinned = max(1, config.torch_threads)
        return ThreadBudget(apply, load, lowest=pinned, highest=pinned)
    start = max(1, load.cores - 2)
    if config.enable_deterministic_inference:
        return ThreadBudget(apply, load, lowest=start, highest=start)
    return ThreadBudget(apply, load, lowest=1, highest=load.cores, start=start)
