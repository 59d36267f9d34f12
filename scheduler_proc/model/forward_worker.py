"""Where a decode forward runs: on a thread of its own (``ForwardThread``, the overlap
schedule), so that the scheduler's host work for the same step goes on meanwhile, or inline
(``InlineForward``, ``--disable-overlap-schedule``). Either way the forward computes the same
ops on the same inputs, so its result is the same bits; only the wall time differs.

torch releases the GIL inside each kernel, so a forward on this thread runs while the
scheduler's thread prefills, fills grammar masks or builds sampling columns. Each side then
runs its ops on one intra-op thread: with ``torch.get_num_threads() > 1`` (the cores are
already the forward's) the forward runs inline.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, TypeVar

import torch

T = TypeVar("T")


def _done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


class ForwardRunner(Protocol):
    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Starts ``fn(*args)``; its result (or its exception) comes back through the future."""

    def close(self) -> None:
        """Waits for a forward under way, then stops the thread (if any)."""


class InlineForward:
    """No overlap: the forward runs when it is submitted."""

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        return _done(fn(*args))

    def close(self) -> None:
        pass


class ForwardThread:
    """One thread that runs the forwards submitted to it, one at a time."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        # The intra-op thread count this thread last set for its own OpenMP team: a thread
        # reads torch's count once, when it first runs an op, and keeps it.
        self._threads = 0

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        threads = torch.get_num_threads()
        if threads > 1:
            return _done(fn(*args))
        return self._pool.submit(self._run, threads, fn, args)

    def _run(self, threads: int, fn: Callable[..., T], args: tuple[object, ...]) -> T:
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads
        return fn(*args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
