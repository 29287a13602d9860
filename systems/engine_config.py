"""Options every system that runs inside fiddler's engine shares (fiddler, mixtral_offloading)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from fiddler.gpu_budget import AUTO
from systems.base import SystemConfig, check, check_number


@dataclass
class EngineSystemConfig(SystemConfig):
    cpu_threads: Optional[int] = None  # None = environment.cpu.threads
    # GiB, or auto: 90% of the free CUDA memory (no GPU without CUDA; mode=simulate: 90% of the environment's
    # card), the library's rule (fiddler.gpu_budget); None = environment.gpu.memory_gb
    gpu_budget_gb: Optional[Union[int, float, str]] = None
    # keep the router's choices of every forward and write them next to the records as a routing trace
    # (fiddler.sim.trace format; mode=simulate replays it with sim.trace=<file>)
    record_routing: bool = False

    def thread_count(self, env_threads: int) -> int:
        return int(self.cpu_threads if self.cpu_threads is not None else env_threads)

    def __post_init__(self) -> None:
        if self.cpu_threads is not None:
            check(lambda: self.cpu_threads >= 1, "system.cpu_threads", self.cpu_threads, "null or an integer >= 1")
        if self.gpu_budget_gb != AUTO:
            check_number("system.gpu_budget_gb", self.gpu_budget_gb, optional=True, note=f" or {AUTO}")
