"""The `${detect:...}` resolver behind `environment=local`: facts read off this host at start.

Values are computed lazily (only keys that are accessed) and cached for the process, so the
memory-bandwidth probe runs at most once and never when the key is overridden.
"""
from __future__ import annotations

import functools
from typing import Any

from omegaconf import OmegaConf

from fiddler import hardware


@functools.lru_cache(maxsize=1)
def measured_cpu_bandwidth() -> dict:
    """This host's memory-read limit, by the project's one probe (fiddler.kernels.read_limit): the
    same function and the same numbers as the engine's decode bound."""
    from fiddler import kernels

    return kernels.read_limit()


def measured_cpu_bandwidth_gbps() -> float:
    return round(float(measured_cpu_bandwidth()["gbps"]), 1)


def _gpu() -> dict[str, Any]:
    return hardware.cuda_device() or {}


_FACTS = {
    "gpu.name": lambda: _gpu().get("name", "none"),
    "gpu.memory_gb": lambda: round(_gpu().get("memory_gb", 0.0), 2),
    # not discoverable from the driver; 0 = unknown (override environment.gpu.* to describe it)
    "gpu.mem_bandwidth_gbps": lambda: 0.0,
    "gpu.bf16_tflops": lambda: 0.0,
    "pcie.h2d_gbps": lambda: 0.0,
    "pcie.d2h_gbps": lambda: 0.0,
    "cpu.name": hardware.cpu_name,
    "cpu.cores": hardware.cpu_cores,
    "cpu.isa": hardware.cpu_isa,
    "cpu.mem_bandwidth_gbps": measured_cpu_bandwidth_gbps,
    "host_memory_gb": lambda: round(hardware.host_memory_gb(), 2),
}


def detect(key: str) -> Any:
    if key not in _FACTS:
        raise KeyError(f"detect: unknown key {key!r}; known: {sorted(_FACTS)}")
    return _FACTS[key]()


def register_resolver() -> None:
    if not OmegaConf.has_resolver("detect"):
        OmegaConf.register_new_resolver("detect", detect, use_cache=True)
