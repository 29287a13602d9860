"""What a benchmark record states about the host it ran on."""
from __future__ import annotations

import platform
from typing import Any

from fiddler import hardware


def host_facts() -> dict[str, Any]:
    flags = hardware.cpu_flags()
    interesting = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return {
        "cpu_name": hardware.cpu_name(),
        "cpu_cores": hardware.cpu_cores(),
        "cpu_isa": hardware.cpu_isa(flags),
        "cpu_amx_bf16": hardware.has_amx_bf16(flags),
        "cpu_flags": interesting,
        "host_memory_gb": round(hardware.host_memory_gb(), 2),
        "gpu": hardware.cuda_device(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
