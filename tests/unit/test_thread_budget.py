"""The scheduler's torch thread count (scheduler_proc/model/thread_budget.py): /proc/stat read
as the kernel writes it, the others' load between two readings, the count's hysteresis (back
off at once, grow on a quiet second), pinning, and the real runner applying it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from pipeline.config import ServerConfig
from scheduler_proc.main import build_scheduler
from scheduler_proc.model.thread_budget import (
    GROW_READINGS,
    PROC_STAT,
    READ_INTERVAL,
    OthersLoad,
    ThreadBudget,
    busy_seconds,
    thread_budget,
)
from scheduler_proc.stats_reporter import SchedulerStatsReporter

# Copied from a 2-core machine's /proc/stat (the intr line cut short).
REAL_PROC_STAT = """\
cpu  2005486 0 199603 1548915 5523 0 6203 1208 0 0
cpu0 896830 0 84806 895571 1634 0 2852 579 0 0
cpu1 1108655 0 114797 653343 3889 0 3350 629 0 0
intr 14599944 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 2 2 1 0 0 1 1 3784 1923
ctxt 53732273
btime 1733044800
processes 98711
procs_running 3
procs_blocked 0
softirq 4467306 0 1402453 170 606374 0 0 42911 1284466 0 1130932
"""
CPU0_BUSY = 896830 + 0 + 84806 + 0 + 2852 + 579  # all but idle (895571) and iowait (1634)
CPU1_BUSY = 1108655 + 0 + 114797 + 0 + 3350 + 629


def stat_text(busy_ticks: list[int], idle_ticks: int = 1000) -> str:
    """/proc/stat with these cumulative busy ticks per CPU (all counted as user time)."""
    total = sum(busy_ticks)
    lines = [f"cpu  {total} 0 0 {idle_ticks * len(busy_ticks)} 0 0 0 0 0 0"]
    lines += [f"cpu{i} {ticks} 0 0 {idle_ticks} 0 0 0 0 0 0" for i, ticks in enumerate(busy_ticks)]
    return "\n".join([*lines, "intr 1 0 0", "ctxt 5", ""])


class Machine:
    """A machine whose others keep ``others`` cores busy and whose scheduler process ``own``
    cores, advanced reading by reading (100 ticks a second, as the kernel reports)."""

    def __init__(self, cores: int = 2) -> None:
        self.cores = cores
        self.busy_ticks = 0.0
        self.own_seconds = 0.0
        self.reads = 0

    def run(self, seconds: float, others: float, own: float) -> None:
        self.busy_ticks += (others + own) * seconds * 100
        self.own_seconds += own * seconds

    def read_stat(self) -> str:
        """The busy ticks shared out among the CPUs, the odd ones on cpu0."""
        self.reads += 1
        total = round(self.busy_ticks)
        share = total // self.cores
        return stat_text([total - share * (self.cores - 1)] + [share] * (self.cores - 1))

    def load(self) -> OthersLoad:
        cpus = frozenset(range(self.cores))
        return OthersLoad(cpus, self.read_stat, lambda: self.own_seconds, 100.0)


class Recorder:
    def __init__(self) -> None:
        self.applied: list[int] = []

    def __call__(self, count: int) -> None:
        self.applied.append(count)


def run_readings(
    budget: ThreadBudget, machine: Machine, start: float, loads: list[float], own: float = 0.8
) -> tuple[float, list[int]]:
    """One reading per entry of ``loads`` (the others' cores over the reading's interval);
    returns the time after the last and the count after each reading."""
    now, counts = start, []
    for others in loads:
        machine.run(READ_INTERVAL, others, own)
        now += READ_INTERVAL
        budget.update(now)
        counts.append(budget.count)
    return now, counts


@pytest.fixture
def two_cores() -> Iterator[tuple[Machine, ThreadBudget, Recorder]]:
    machine, applied = Machine(), Recorder()
    budget = ThreadBudget(applied, machine.load(), lowest=1, highest=2, start=1)
    budget.update(0.0)  # the baseline reading
    yield machine, budget, applied


def test_busy_seconds_reads_the_kernels_columns() -> None:
    assert busy_seconds(REAL_PROC_STAT, frozenset({0}), 100.0) == CPU0_BUSY / 100
    assert busy_seconds(REAL_PROC_STAT, frozenset({1}), 100.0) == CPU1_BUSY / 100
    both = busy_seconds(REAL_PROC_STAT, frozenset({0, 1}), 100.0)
    assert both == (CPU0_BUSY + CPU1_BUSY) / 100, "the aggregate cpu line is not counted again"
    assert busy_seconds(REAL_PROC_STAT, frozenset({7}), 100.0) == 0.0


def test_busy_seconds_of_this_machines_proc_stat_grow() -> None:
    cpus = frozenset(os.sched_getaffinity(0))
    first = busy_seconds(PROC_STAT.read_text(), cpus, float(os.sysconf("SC_CLK_TCK")))
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # this process's own CPU time shows up as busy
        pass
    second = busy_seconds(PROC_STAT.read_text(), cpus, float(os.sysconf("SC_CLK_TCK")))
    assert 0 < first < second


def test_others_load_is_busy_time_less_own_time() -> None:
    machine = Machine()
    load = machine.load()
    assert load.read(10.0) is None, "the first reading is the baseline"
    machine.run(0.5, others=0.6, own=1.0)
    assert load.read(10.5) == pytest.approx(0.6)
    machine.run(0.5, others=0.0, own=2.0)
    assert load.read(11.0) == pytest.approx(0.0)
    machine.own_seconds += 0.3  # the process's clock ran ahead of the kernel's ticks
    assert load.read(11.5) == 0.0, "never below zero"


def test_grows_only_after_quiet_readings_in_a_row(
    two_cores: tuple[Machine, ThreadBudget, Recorder],
) -> None:
    machine, budget, applied = two_cores
    now, counts = run_readings(budget, machine, 0.0, [0.1] * (GROW_READINGS - 1) + [0.9])
    assert counts == [1] * GROW_READINGS, "a busy reading holds the count for a second"
    now, counts = run_readings(budget, machine, now, [0.1] * GROW_READINGS)
    assert counts == [1] * (GROW_READINGS - 1) + [2]
    assert applied.applied == [1, 2]


def test_grows_on_the_seconds_average(
    two_cores: tuple[Machine, ThreadBudget, Recorder],
) -> None:
    """Readings of a light output path (API, detokenizer and client): each a few ticks, some
    above the average's bound. A second of 0.35 core on average keeps one thread."""
    machine, budget, _ = two_cores
    _, counts = run_readings(budget, machine, 0.0, [0.24, 0.04, 0.4, 0.12])
    assert counts == [1, 1, 1, 2]
    busier = Machine()
    budget = ThreadBudget(Recorder(), busier.load(), lowest=1, highest=2, start=1)
    budget.update(0.0)
    _, counts = run_readings(budget, busier, 0.0, [0.35] * (2 * GROW_READINGS))
    assert counts == [1] * (2 * GROW_READINGS)


def test_backs_off_at_the_first_busy_reading(
    two_cores: tuple[Machine, ThreadBudget, Recorder],
) -> None:
    machine, budget, applied = two_cores
    now, _ = run_readings(budget, machine, 0.0, [0.0] * GROW_READINGS)
    assert budget.count == 2
    now, counts = run_readings(budget, machine, now, [0.4, 0.45, 0.7, 0.1, 0.4])
    assert counts == [2, 2, 1, 1, 1], "holds 2 up to half a core of others, then 1 at once"
    assert applied.applied == [1, 2, 1]


def test_others_on_a_whole_core_keep_one_thread(
    two_cores: tuple[Machine, ThreadBudget, Recorder],
) -> None:
    machine, budget, applied = two_cores
    _, counts = run_readings(budget, machine, 0.0, [0.3, 1.0, 0.25, 1.2] * GROW_READINGS)
    assert set(counts) == {1} and applied.applied == [1]


def test_grows_to_what_every_quiet_reading_left_room_for() -> None:
    machine, applied = Machine(cores=4), Recorder()
    budget = ThreadBudget(applied, machine.load(), lowest=1, highest=4, start=1)
    budget.update(0.0)
    now, counts = run_readings(budget, machine, 0.0, [0.1, 1.1, 0.0, 0.1], own=1.0)
    assert counts == [1, 1, 1, 3], "one reading left room for 3 threads only"
    now, counts = run_readings(budget, machine, now, [0.1] * GROW_READINGS, own=3.0)
    assert counts[-1] == 4
    _, counts = run_readings(budget, machine, now, [2.0, 2.9], own=1.0)
    assert counts == [2, 1], "backs off by as many threads as the others need at once"
    assert applied.applied == [1, 3, 4, 2, 1]


def test_reads_at_most_once_per_interval(
    two_cores: tuple[Machine, ThreadBudget, Recorder],
) -> None:
    machine, budget, _ = two_cores
    reads = machine.reads
    for step in range(100):  # steps of 1 ms
        budget.update(step / 1000)
    assert machine.reads == reads, "the baseline was read at 0.0: the next is due at 0.25"
    budget.update(READ_INTERVAL)
    assert machine.reads == reads + 1


def test_pinned_count_never_reads() -> None:
    def no_reading() -> str:
        raise AssertionError("a pinned count must not read /proc/stat")

    applied = Recorder()
    load = OthersLoad(frozenset({0, 1}), no_reading, time.process_time, 100.0)
    budget = ThreadBudget(applied, load, lowest=3, highest=3)
    for now in (0.0, 1.0, 100.0):
        budget.update(now)
    assert budget.pinned and budget.count == 3 and applied.applied == [3]


def test_unreadable_proc_stat_keeps_the_count() -> None:
    def unreadable() -> str:
        raise PermissionError("/proc/stat")

    applied = Recorder()
    load = OthersLoad(frozenset({0, 1}), unreadable, time.process_time, 100.0)
    budget = ThreadBudget(applied, load, lowest=1, highest=2, start=1)
    budget.update(0.0)
    budget.update(10.0)
    assert budget.pinned and budget.count == 1 and applied.applied == [1]


def test_config_picks_the_range() -> None:
    cores = len(os.sched_getaffinity(0))
    start = max(1, cores - 2)
    auto = thread_budget(ServerConfig(), Recorder())
    assert (auto.lowest, auto.highest, auto.count) == (1, cores, start)
    assert auto.pinned == (cores == 1)
    pinned = thread_budget(ServerConfig(torch_threads=5), Recorder())
    assert pinned.pinned and pinned.count == 5
    assert thread_budget(ServerConfig(torch_threads=0), Recorder()).count == 1
    deterministic = thread_budget(ServerConfig(enable_deterministic_inference=True), Recorder())
    assert deterministic.pinned and deterministic.count == start, "the count is in the bits"


def restoring_torch_threads(test: Callable[[], None]) -> None:
    before = torch.get_num_threads()
    try:
        test()
    finally:
        torch.set_num_threads(before)


def test_the_runner_applies_the_count_and_the_report_carries_it() -> None:
    def check() -> None:
        scheduler = build_scheduler(ServerConfig(max_total_tokens=1024, torch_threads=2))
        assert torch.get_num_threads() == 2
        assert SchedulerStatsReporter(scheduler).report(time.time()).torch_threads == 2

    restoring_torch_threads(check)
