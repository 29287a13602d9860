"""The harness's one hardware module: what it reads off this host and what it makes of an environment.

- `${detect:...}`, the resolver behind `environment=local`: facts read off this host at start. Values are
  computed lazily (only keys that are accessed) and cached for the process, so the memory-bandwidth probe runs
  at most once and never when the key is overridden.
- `host_facts()`: what a benchmark record states about the host it ran on.
- `hardware_spec(env)`: fiddler.latency.HardwareSpec from an environment config (conf/environment/*.yaml).

The library's side is fiddler/hardware.py (CPUID, cores, memory, the CUDA device), which this reads.
"""
from __future__ import annotations

import functools
import json
import os
import platform
from typing import Any

from omegaconf import OmegaConf

from fiddler import hardware as fh


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
    return fh.cuda_device() or {}


_FACTS = {
    "gpu.name": lambda: _gpu().get("name", "none"),
    "gpu.memory_gb": lambda: round(_gpu().get("memory_gb", 0.0), 2),
    # not discoverable from the driver; 0 = unknown (override environment.gpu.* to describe it)
    "gpu.mem_bandwidth_gbps": lambda: 0.0,
    "gpu.bf16_tflops": lambda: 0.0,
    "pcie.h2d_gbps": lambda: 0.0,
    "pcie.d2h_gbps": lambda: 0.0,
    "cpu.name": fh.cpu_name,
    "cpu.cores": fh.cpu_cores,
    "cpu.isa": fh.cpu_isa,
    "cpu.mem_bandwidth_gbps": measured_cpu_bandwidth_gbps,
    "host_memory_gb": lambda: round(fh.host_memory_gb(), 2),
}


def detect(key: str) -> Any:
    if key not in _FACTS:
        raise KeyError(f"detect: unknown key {key!r}; known: {sorted(_FACTS)}")
    return _FACTS[key]()


def register_resolver() -> None:
    if not OmegaConf.has_resolver("detect"):
        OmegaConf.register_new_resolver("detect", detect, use_cache=True)


def host_facts() -> dict[str, Any]:
    flags = fh.cpu_flags()
    interesting = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return {
        "cpu_name": fh.cpu_name(),
        "cpu_cores": fh.cpu_cores(),
        "cpu_isa": fh.cpu_isa(flags),
        "cpu_amx_bf16": fh.has_amx_bf16(flags),
        "cpu_flags": interesting,
        "host_memory_gb": round(fh.host_memory_gb(), 2),
        "gpu": fh.cuda_device(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def hardware_spec(env: dict[str, Any], **overrides):
    """fiddler.latency.HardwareSpec from a resolved environment config as plain values (the runner converts
    enums to strings): gpu.*, pcie.*, cpu.*. Missing GPU and PCIe numbers mean none."""
    from fiddler.latency import HardwareSpec  # torch: only where a spec is built, not at the harness's start

    gpu, pcie, cpu = env.get("gpu") or {}, env.get("pcie") or {}, env["cpu"]
    kw = dict(
        gpu_mem_bandwidth_gbps=float(gpu.get("mem_bandwidth_gbps", 0.0)),
        gpu_bf16_tflops=float(gpu.get("bf16_tflops", 0.0)),
        pcie_h2d_gbps=float(pcie.get("h2d_gbps", 0.0)),
        pcie_d2h_gbps=float(pcie.get("d2h_gbps", 0.0)),
        cpu_mem_bandwidth_gbps=float(cpu["mem_bandwidth_gbps"]),
        cpu_cores=int(cpu["cores"]),
        cpu_threads=cpu.get("threads"),
        cpu_isa=str(cpu.get("isa", "avx512_bf16")),
    )
    kw.update(overrides)
    return HardwareSpec(**kw)
