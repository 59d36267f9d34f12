"""Timers that wrap the scheduler's stages for the timed steps: the extend (or the running
batch's decode pass), the model forward, the sampler, and with ``--constrained`` the grammar's
mask fill, apply and accept. On CUDA each timer synchronizes before reading the clock, so
kernel time is charged to the call that launched it rather than to a later ``.tolist()``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from scheduler_proc.sampling.grammar import GrammarMask, NoGrammars
from scheduler_proc.scheduler import Scheduler


class Timer:
    """Wraps a callable; sums the wall time of its calls (synchronizing CUDA first)."""

    def __init__(self, fn: Callable[..., Any], sync: Callable[[], None] | None) -> None:
        self.fn = fn
        self.sync = sync
        self.total_ns = 0
        self.calls = 0
        self._others: list[Timer] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = self.fn(*args, **kwargs)
        if self.sync is not None:
            self.sync()
        self.total_ns += time.perf_counter_ns() - t0
        self.calls += 1
        return out

    def also(self, other: Timer) -> None:
        """``take`` also takes ``other``'s time: two entry points to one stage."""
        self._others.append(other)

    def take(self) -> int:
        total, self.total_ns = self.total_ns, 0
        return total + sum(other.take() for other in self._others)


GrammarTimers = tuple[Timer, Timer, Timer, Callable[[], None]]


def instrument_grammar(scheduler: Scheduler) -> GrammarTimers:
    """Timers of the mask fill, apply and accept, and the undo of the apply's wrapper (a
    class attribute: a mask is a new object every step)."""
    masks = scheduler.masks
    if isinstance(masks, NoGrammars):
        raise RuntimeError("--constrained needs a scheduler with a tokenizer")
    sync = torch.cuda.synchronize if scheduler.runner.device.type == "cuda" else None
    fill, accept = Timer(masks.fill, sync), Timer(masks.accept, sync)
    original = GrammarMask.apply
    apply = Timer(original, sync)

    def timed_apply(mask: GrammarMask, logits: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = apply(mask, logits)
        return result

    # setattr, as in instrument: instance attributes shadow the two methods, and the
    # apply's wrapper goes on the class (a mask is a new object every step).
    shadowed: tuple[tuple[object, str, Callable[..., Any]], ...] = (
        (masks, "fill", fill),
        (masks, "accept", accept),
        (GrammarMask, "apply", timed_apply),
    )
    for owner, name, timer in shadowed:
        setattr(owner, name, timer)
    return fill, apply, accept, lambda: setattr(GrammarMask, "apply", original)


def instrument(scheduler: Scheduler) -> tuple[Timer, Timer, Timer]:
    """Instance attributes shadow the bound methods the scheduler and runner call: returns
    the timers of extend, forward and sample."""
    runner = scheduler.runner
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else None
    extend = Timer(runner.extend, sync)
    # A steady decode step's pass is runner.decode (the running batch's columns); it counts
    # as the extend: the ForwardBatch build plus the forward.
    decode = Timer(runner.decode, sync)
    extend.also(decode)
    forward = Timer(runner.model.forward, sync)
    sample = Timer(runner.sample, sync)
    # setattr: replacing a method of one instance is what the types forbid, and the point here.
    shadowed = (
        (runner, "extend", extend),
        (runner, "decode", decode),
        (runner.model, "forward", forward),
        (runner, "sample", sample),
    )
    for owner, name, timer in shadowed:
        setattr(owner, name, timer)
    return extend, forward, sample
