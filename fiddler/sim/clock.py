"""The virtual clock: lanes that each run one thing at a time, in the order work is issued.

A lane is what the real executor runs concurrently (fiddler/executors/orchestrator.py): the CPU (its
kernel queue, all threads), the GPU (one compute stream) and one copy engine per PCIe direction (the
copies' own stream). `run(ready, seconds)` starts work when both the lane is free and its input is
ready, like an in-order CUDA stream fed with events, and returns when it ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Lane:
    name: str
    free_at: float = 0.0
    busy_s: float = 0.0

    def run(self, ready: float, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"{self.name}: negative duration {seconds}")
        start = max(self.free_at, ready)
        self.free_at = start + seconds
        self.busy_s += seconds
        return self.free_at


@dataclass
class Clock:
    cpu: Lane = field(default_factory=lambda: Lane("cpu"))
    gpu: Lane = field(default_factory=lambda: Lane("gpu"))
    h2d: Lane = field(default_factory=lambda: Lane("h2d"))
    d2h: Lane = field(default_factory=lambda: Lane("d2h"))

    def lanes(self) -> tuple[Lane, ...]:
        return (self.cpu, self.gpu, self.h2d, self.d2h)

    def busy(self) -> dict[str, float]:
        return {lane.name: lane.busy_s for lane in self.lanes()}
