"""The threads that compile grammars (docs/design/structured-outputs.md): a few workers take
jobs in arrival order, so a slow compile holds up its own requests and not every other new
spec. A compile cannot be stopped once it runs (xgrammar has no cancel): the owner writes off
one that runs past its limit, a fresh worker takes its place, and the stuck thread leaves
when its compile returns. At most ``threads`` written-off compiles get a replacement at a
time; past that, a stuck compile narrows the pool until it returns. A job not yet started
can be cancelled, and then never runs.

The workers are daemon threads, so a compile that never returns cannot keep the process
alive; but a process must not finalize its interpreter while one runs in xgrammar's C++
(Python then ends the thread by unwinding it, and C++ answers with std::terminate: SIGABRT
instead of a clean exit). ``close`` says whether every worker has left.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

K = TypeVar("K")
R = TypeVar("R")


class CompileJob(Generic[K, R]):
    """One compile: its key, its future, and when a worker started it (monotonic seconds;
    None while it waits, or while the engine it needs is still being made)."""

    __slots__ = ("key", "future", "started", "_returned", "_replaced")

    def __init__(self, key: K) -> None:
        self.key = key
        self.future: Future[R] = Future()
        self.started: float | None = None  # set by the worker, read by the owner
        self._returned = False  # these two under the pool's lock
        self._replaced = False  # written off, and a fresh worker took its thread's place

    def ran_for(self, now: float) -> float:
        """Seconds it has run by ``now`` (0 before it starts)."""
        started = self.started
        return 0.0 if started is None else now - started


class CompilePool(Generic[K, R]):
    """``threads`` workers running ``run(key)`` for each submitted job, each after
    ``prepare()`` (the engine the compile needs: it blocks until made, and its time is not
    the compile's). ``clock`` (monotonic seconds) stamps when a job starts. The workers hold
    the pool weakly: once it is gone, they stop."""

    def __init__(
        self,
        run: Callable[[K], R],
        prepare: Callable[[], object],
        threads: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run = run
        self._prepare = prepare
        self._clock = clock
        self._threads = threads
        self._jobs: queue.SimpleQueue[CompileJob[K, R] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stuck = 0  # written-off compiles whose worker was replaced and still runs
        self._workers: list[threading.Thread] = []  # under the lock
        weakref.finalize(self, self._jobs.put, None)
        for _ in range(threads):
            self._spawn()

    def _spawn(self) -> None:
        """A new worker (under the lock, or while the pool is made)."""
        # Daemon: a compile that never returns must not keep the process from exiting.
        worker = threading.Thread(
            target=_work, args=(weakref.ref(self), self._jobs), name="grammar-compile", daemon=True
        )
        self._workers = [w for w in self._workers if w.is_alive()] + [worker]
        worker.start()

    def submit(self, key: K) -> CompileJob[K, R]:
        job: CompileJob[K, R] = CompileJob(key)
        self._jobs.put(job)
        return job

    @staticmethod
    def cancel(job: CompileJob[K, R]) -> bool:
        """Whether the job was cancelled before a worker took it (then it never runs)."""
        return job.future.cancel()

    def write_off(self, job: CompileJob[K, R]) -> bool:
        """Gives up on a running job: a fresh worker takes its thread's place (while fewer
        than ``threads`` are stuck). False when the job returned meanwhile: its future holds
        the outcome."""
        with self._lock:
            if job._returned:
                return False
            if self._stuck < self._threads:
                self._stuck += 1
                job._replaced = True
                self._spawn()
            return True

    def close(self, wait: float = 0.0) -> bool:
        """Stops the workers once they are idle, waiting up to ``wait`` seconds for them (a
        compile under way is left to finish); whether they have all left."""
        self._jobs.put(None)
        deadline = time.monotonic() + wait  # a real wait, whatever clock stamps the jobs
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        return not any(worker.is_alive() for worker in workers)

    def run(self, job: CompileJob[K, R]) -> bool:
        """Runs one job on the calling worker; True when the worker must then leave (the job
        was written off and a replacement took its place)."""
        try:
            self._prepare()
            job.started = self._clock()
            outcome = self._run(job.key)
            fault: Exception | None = None
        except Exception as exc:  # a fault, not a bad spec: the owner reports it
            fault = exc
        with self._lock:
            job._returned = True
            leave = job._replaced
            if leave:
                self._stuck -= 1
        if fault is not None:
            job.future.set_exception(fault)
        else:
            job.future.set_result(outcome)
        return leave


def _work(pool_ref: weakref.ref[CompilePool[K, R]], jobs: queue.SimpleQueue[Any]) -> None:
    """A worker: takes jobs until the pool closes or is gone."""
    while True:
        job = jobs.get()
        if job is None:
            jobs.put(None)  # the next worker stops too
            return
        if not job.future.set_running_or_notify_cancel():
            continue  # cancelled while it waited
        pool = pool_ref()
        if pool is None:
            return
        leave = pool.run(job)
        del pool  # between jobs the pool is held by its owner alone
        if leave:
            return
