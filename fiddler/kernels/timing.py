"""How the project times a piece of work: the best of a few runs, on a clock that can be injected.

The kernels' tuners, the roofline probe, `fiddler.latency.best_time` and the engine's per-thread CPU-time
comparisons (on their own clock, time.thread_time) all time through here. The clock is looked up when a
timing starts (`time.perf_counter` unless one is given), so a test can replace it and assert on injected
timings rather than real ones.
"""
from __future__ import annotations

import time
from typing import Any, Callable


def elapsed(fn: Callable[[], Any], clock: Callable[[], float] | None = None) -> float:
    """Seconds one fn() took on `clock` (default time.perf_counter)."""
    clock = clock or time.perf_counter
    t = clock()
    fn()
    return clock() - t


def best_time(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1,
              clock: Callable[[], float] | None = None) -> float:
    """Best-of-`repeats` time of fn() after `warmup` untimed calls (fn must synchronise any asynchronous
    device work itself); wall time unless another clock is given (the engine compares implementations on
    one thread in that thread's CPU time, time.thread_time: on a shared machine wall time would measure
    the scheduler)."""
    for _ in range(warmup):
        fn()
    return min((elapsed(fn, clock) for _ in range(repeats)), default=float("inf"))

