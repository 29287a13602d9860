"""The highest arrival rate a server sustains within latency limits (MLPerf Inference's Server scenario: the
highest Poisson rate at which the p99 TTFT and TPOT stay within the model's limits).

Pure logic, measured through a callable, so that it is tested with injected measurements. The search assumes
that a rate within the limits implies every lower rate is (more load never lowers a p99, up to noise). It keeps,
per set of limits, a bracket: the highest rate seen within them and the lowest seen beyond them, and measures
next the rate that halves the widest bracket (geometrically), starting from the capacity the server showed at
full concurrency; a side not yet seen is found by halving (nothing within yet) or by going 1.5x up (nothing
beyond yet). At most max_trials rates, fewer once every bracket is within `resolution`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Slo:
    """p99 limits; name says where they come from ("mlperf", "scaled")."""

    name: str
    ttft_s: float
    tpot_s: float

    def met(self, trial: "Trial") -> bool:
        return trial.ttft_p99_s <= self.ttft_s and trial.tpot_p99_s <= self.tpot_s


@dataclass(frozen=True)
class Trial:
    """One rate's measurement: its p99s and how many requests they come from."""

    rate: float
    ttft_p99_s: float
    tpot_p99_s: float
    requests: int
    extra: dict = field(default_factory=dict, compare=False)  # the level's other metrics, for the record


@dataclass
class Bracket:
    within: float | None = None  # highest rate measured within the limits
    beyond: float | None = None  # lowest rate measured beyond them

    def update(self, rate: float, ok: bool) -> None:
        if ok and (self.within is None or rate > self.within):
            self.within = rate
        if not ok and (self.beyond is None or rate < self.beyond):
            self.beyond = rate

    def width(self) -> float:
        """beyond / within; inf while a side is unknown."""
        if self.within is None or self.beyond is None:
            return math.inf
        return self.beyond / self.within

    def next_rate(self) -> float:
        if self.within is None:
            return self.beyond / 2
        if self.beyond is None:
            return self.within * 1.5
        return math.sqrt(self.within * self.beyond)


def search(measure: Callable[[float], Trial], capacity: float, slos: list[Slo], max_trials: int = 5,
           resolution: float = 1.1) -> tuple[list[Trial], dict[str, Bracket]]:
    """Trials in the order measured, and per SLO name its bracket (bracket.within: the answer; None when no
    measured rate was within the limits)."""
    if not capacity > 0:
        raise ValueError(f"capacity must be > 0 requests/s, got {capacity}")
    brackets = {s.name: Bracket() for s in slos}
    trials: list[Trial] = []
    rate = capacity
    while len(trials) < max_trials:
        trial = measure(rate)
        trials.append(trial)
        for s in slos:
            brackets[s.name].update(trial.rate, s.met(trial))
        widest = max(brackets.values(), key=Bracket.width)
        if widest.width() <= resolution:
            break
        rate = widest.next_rate()
        if any(math.isclose(rate, t.rate, rel_tol=1e-3) for t in trials):
            break  # nothing new to learn
    return trials, brackets
