"""The `${detect:...}` resolver behind `environment=local`: facts read off this host at start.

Values are computed lazily (only keys that are accessed) and cached for the process, so the
memory-bandwidth probe runs at most once and never when the key is overridden.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any

from omegaconf import OmegaConf

from fiddler import hardware


# A sweep's child processes inherit the parent's measurement through this variable, so every record of
# a run states the same limit (environment=local's value and each record's decode bound).
_LIMIT_ENV = "FIDDLER_READ_LIMIT"


@functools.lru_cache(maxsize=1)
def measured_cpu_bandwidth() -> dict:
    """This host's memory-read limit, by the project's one probe (fiddler.kernels.read_limit): the
    same function and the same numbers as the decode bound. Measured once per run."""
    inherited = os.environ.get(_LIMIT_ENV)
    if inherited:
        try:
            d = json.loads(inherited)
            if isinstance(d, dict) and float(d["gbps"]) > 0 and isinstance(d.get("strategies"), dict):
                return d
        except (ValueError, KeyError, TypeError):
            pass  # damaged: measure again
    from fiddler import kernels

    d = kernels.read_limit()
    os.environ[_LIMIT_ENV] = json.dumps(d)
    return d


def known_read_limit() -> dict | None:
    """The limit measured earlier in this run (this process or its parent), without measuring."""
    inherited = os.environ.get(_LIMIT_ENV)
    return measured_cpu_bandwidth() if inherited or measured_cpu_bandwidth.cache_info().currsize else None


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
