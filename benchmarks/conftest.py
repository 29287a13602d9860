"""The regression suite's shared machinery (run by scripts/regress.py; not part of `pytest -q`).

Every benchmark measures a *ratio* of two sides timed in the same process, interleaved round by round
(A, B, A, B, ...), and keeps the best time of each side: on a shared machine a quiet moment then
benefits both sides alike. pytest-benchmark drives the rounds (`benchmark.pedantic`), times each
whole round and writes the JSON report; the ratio, the best time of each side and what the sides
were go to `benchmark.extra_info`, which scripts/regress.py compares with the committed floors.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import pytest


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", default=False,
                     help="the CI subset: the tiny model and one Mixtral-size expert, fewer rounds")


@pytest.fixture(scope="session")
def quick(request) -> bool:
    return bool(request.config.getoption("--quick"))


@pytest.fixture(scope="session")
def rounds(quick) -> int:
    return int(os.environ.get("FIDDLER_REGRESS_ROUNDS", 5 if quick else 9))


def record_ratio(benchmark, name: str, value: float, direction: str, sides: dict, what: str, **extra) -> None:
    """Stores one ratio for scripts/regress.py. direction: "higher" (a floor: the value must stay at
    or above it) or "lower" (a ceiling). extra may carry `margin`: how far below its readings the
    floor of a noisier ratio sits (scripts/regress.py uses its file's default otherwise), and
    `report_only`: why the ratio means nothing on the path that ran (printed and recorded, never floored)."""
    assert direction in ("higher", "lower")
    benchmark.extra_info.setdefault("ratios", []).append(
        {"name": name, "value": float(value), "direction": direction, "what": what,
         "sides": {k: float(v) for k, v in sides.items()}, **extra})


def skip_ratios(names: list[str], reason: str) -> None:
    """Skips the calling benchmark and tells scripts/regress.py which ratios it would have measured."""
    path = os.environ.get("FIDDLER_REGRESS_SKIPS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"ratios": names, "reason": reason}) + "\n")
    pytest.skip(reason)


def interleaved(benchmark, sides: dict[str, Callable[[int], float | None]], rounds: int,
                warmup: int = 1) -> dict[str, float]:
    """Runs every side once per round, in order, for `rounds` rounds (after `warmup` unrecorded
    ones) and returns each side's best value. A side is fn(round) -> seconds it measured itself (a
    float), or anything else (None, a tensor) to be timed here as a whole call."""
    best = {k: float("inf") for k in sides}
    count = [0]

    def one_round():
        i = count[0]
        count[0] += 1
        for k, fn in sides.items():
            t = time.perf_counter()
            v = fn(i)
            dt = v if isinstance(v, float) else time.perf_counter() - t
            if i >= warmup:
                best[k] = min(best[k], dt)

    benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=warmup, iterations=1)
    return best


def own_memory_limit(copies: list, weight_bytes: int) -> Callable[[int], float]:
    """The read-limit side of a kernel ratio, fn(round) -> the seconds the limit allows for `weight_bytes`:
    in round i one of read_limit's strategies, in turn, reads the weights of copy (i + n/2) mod n once,
    cold (fiddler.kernels.read_once_gbps). The kernel side streams copy i mod n, so both sides read the
    same memory, each copy last touched n/2 rounds before by the other side. A limit probe re-reading
    its own 1 GiB buffer every round measures warmer memory than weights cycled through GBs. On an Intel
    Xeon VM (family 6 model 167, 2026-12-05), a plain read of 12 cycled expert copies ran at 20.1 GB/s
    (median) against 29.2 for the 1 GiB buffer, and the kernel streamed those copies at 19.5
    (results/measured/2026-12-05-intel-xeon-amx-near-prefetch)."""
    import fiddler.kernels as fk

    n = len(copies)

    def side(i: int) -> float:
        e = copies[(i + n // 2) % n]
        strategy = fk.READ_ONCE_STRATEGIES[i % len(fk.READ_ONCE_STRATEGIES)]
        seconds = sum(b.numel() / (fk.read_once_gbps(b, strategy) * 1e9) for b in (e._w13, e._w2))
        return seconds * weight_bytes / e.nbytes

    return side


def python_yardstick() -> float:
    """A fixed pure-Python workload (never change it: every planner ratio is in its units), shaped like
    a planner's work: a brute force over the 2^8 splits of 8 float costs, with calls, tuples, list
    indexing and max/sum on floats. Returns a checksum so that nothing is optimised away."""
    costs = [0.5 + 0.125 * i for i in range(8)]
    copy = [0.25 + 0.0625 * i for i in range(8)]

    def queue(gpu0: float, items: tuple) -> float:
        done, g, c = [0.0] * len(items), gpu0, 0.0
        for i, t in enumerate(items):
            c = max(c, done[i - 2] if i >= 2 else 0.0) + 0.3
            g = done[i] = max(g, c) + t
        return g

    best = float("inf")
    for mask in range(1 << 8):
        cpu = sum(costs[e] for e in range(8) if mask >> e & 1)
        gpu = queue(0.1, tuple(copy[e] for e in range(8) if not mask >> e & 1))
        best = min(best, max(cpu, gpu))
    return best
