"""fiddler.latency.HardwareSpec from the harness's environment config (conf/environment/*.yaml)."""
from __future__ import annotations

from typing import Any

from fiddler.latency import HardwareSpec


def hardware_spec(env: dict[str, Any], **overrides) -> HardwareSpec:
    """From a resolved environment config as plain values (the runner converts enums to strings):
    gpu.*, pcie.*, cpu.*. Missing GPU and PCIe numbers mean none."""
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
