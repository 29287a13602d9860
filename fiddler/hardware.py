"""Facts about the machine we run on: CPU model, cores, ISA flags, RAM, CUDA GPU.

Used by the engine (thread counts, kernel dispatch) and by the harness (`environment=local`, the host
facts of its records). Only the standard library, psutil and torch.
"""
from __future__ import annotations

import functools
import os
import platform
from typing import Any

# ISA levels the project distinguishes, best first. `avx512_bf16` has vdpbf16ps; `avx512` is
# Skylake-class (F/BW/VL, no BF16); `avx2` is the portable floor (Haswell and newer).
ISA_LEVELS = ("avx512_bf16", "avx512", "avx2")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@functools.lru_cache(maxsize=1)
def cpu_description() -> str:
    """cpu_name() with its family and model numbers (VMs often report a bare "Intel(R) Xeon(R) Processor")."""
    try:
        info = open("/proc/cpuinfo").read().splitlines()
        get = lambda key: next(l.split(":", 1)[1].strip() for l in info if l.startswith(key))  # noqa: E731
        return f"{get('model name')} (family {get('cpu family')} model {get('model')})"
    except (OSError, StopIteration):
        return cpu_name()


def cpu_isa(flags: frozenset[str] | None = None) -> str:
    """Best ISA level of ISA_LEVELS this CPU supports ('avx2' is reported as the floor)."""
    flags = cpu_flags() if flags is None else flags
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
    if avx512 and "avx512_bf16" in flags:
        return "avx512_bf16"
    if avx512:
        return "avx512"
    return "avx2"


def has_amx_bf16(flags: frozenset[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return {"amx_bf16", "amx_tile"} <= flags


def cpu_cores() -> int:
    """Cores usable by this process (affinity-aware; a container may have fewer than the host)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_memory_gb() -> float:
    try:
        import psutil

        return psutil.virtual_memory().total / 2**30
    except Exception:  # psutil missing or unreadable /proc
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30


def cuda_device() -> dict[str, Any] | None:
    """Name and memory of CUDA device 0, or None without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return {"name": props.name, "memory_gb": props.total_memory / 2**30,
                "capability": f"{props.major}.{props.minor}"}
    except Exception:
        return None
