"""Costs of work on the simulated machine: a CPU matmul, a GPU kernel, a PCIe copy, from bytes and FLOPs.

- CPU: bytes / (read limit x kernel fraction) + FLOPs / (threads x GEMM rate per core) + a call overhead.
  The sum (not the max) is what the measured kernels follow: streaming and compute do not fully overlap at
  the sizes that matter (results/measured/2026-12-01-intel-xeon-gemm).
- GPU: max(bytes / (bandwidth x fraction), FLOPs / (TFLOP/s x fraction)) + a launch floor (a roofline).
- PCIe: bytes / (rate x fraction) + latency, one copy engine per direction.

The planner's latency model comes from the same numbers through the engine's own
`fiddler.latency.LatencyModel.from_hardware_spec`, so what the planner predicts and what the clock
charges agree.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..latency import HardwareSpec, LatencyModel
from .efficiency import Efficiency


@dataclass(frozen=True)
class SimHardware:
    spec: HardwareSpec  # the environment's numbers, efficiency fields filled from `eff`
    eff: Efficiency
    threads: int
    limit_gbps: float  # the CPU read limit the kernel is judged against
    limit_source: str

    @classmethod
    def build(cls, spec: HardwareSpec, eff: Efficiency, *, measured_limit: bool) -> SimHardware:
        """`measured_limit`: spec.cpu_mem_bandwidth_gbps is already a measured read limit
        (environment=local); otherwise it is the spec sheet's theoretical bandwidth."""
        threads = int(spec.cpu_threads or spec.cpu_cores)
        if measured_limit:
            limit, source = spec.cpu_mem_bandwidth_gbps, "measured read limit (environment=local)"
        else:
            limit = spec.cpu_mem_bandwidth_gbps * eff.cpu.limit_of_theoretical
            source = (f"theoretical {spec.cpu_mem_bandwidth_gbps:g} GB/s x limit_of_theoretical "
                      f"{eff.cpu.limit_of_theoretical:g} ({eff.cpu.name})")
        g = eff.gpu
        # HardwareSpec's FLOP/s = threads x ghz x flops_per_cycle x eff: the class gives achieved GFLOP/s per
        # core directly, so ghz=1 and flops_per_cycle = that rate.
        full = replace(spec, cpu_threads=threads, cpu_ghz=1.0, cpu_flops_per_cycle_override=eff.cpu.gemm_gflops_per_core,
                       cpu_flops_eff=1.0, cpu_bw_eff=limit / spec.cpu_mem_bandwidth_gbps * eff.cpu.kernel_bw_fraction,
                       gpu_bw_eff=g.bw_fraction, gpu_flops_eff=g.flops_fraction, pcie_eff=g.pcie_fraction,
                       gpu_launch_overhead_s=g.launch_s, pcie_latency_s=g.pcie_latency_s)
        return cls(full, eff, threads, float(limit), source)

    # ------------------------------------------------------------------ facts
    @property
    def has_gpu(self) -> bool:
        return self.spec.gpu_mem_bandwidth_gbps > 0 and self.spec.gpu_bf16_tflops > 0

    @property
    def cpu_read_gbps(self) -> float:
        return self.spec.cpu_mem_bandwidth_gbps * self.spec.cpu_bw_eff

    @property
    def cpu_gflops(self) -> float:
        return self.threads * self.eff.cpu.gemm_gflops_per_core

    def latency_model(self, config, dtype: torch.dtype, quant: str | None = None) -> LatencyModel:
        """The planner's per-expert model, by the engine's own constructor (quant: quantized expert bytes)."""
        return LatencyModel.from_hardware_spec(self.spec, config, dtype, cpu_threads=self.threads, quant=quant)

    # ------------------------------------------------------------------ costs (seconds)
    def cpu(self, nbytes: float, flops: float, *, bw_fraction: float | None = None,
            gflops_per_core: float | None = None) -> float:
        """A CPU matmul-like op. bw_fraction / gflops_per_core: another implementation's factors
        (a baseline's own kernels) instead of fiddler's."""
        bw = self.limit_gbps * (bw_fraction if bw_fraction is not None else self.eff.cpu.kernel_bw_fraction)
        rate = self.threads * (gflops_per_core if gflops_per_core is not None else self.eff.cpu.gemm_gflops_per_core)
        return nbytes / (bw * 1e9) + flops / (rate * 1e9) + self.spec.cpu_call_overhead_s

    def gpu(self, nbytes: float, flops: float, launches: int = 1) -> float:
        if not self.has_gpu:
            raise ValueError("this environment has no GPU (gpu.mem_bandwidth_gbps or gpu.bf16_tflops is 0)")
        s = self.spec
        return max(nbytes / (s.gpu_mem_bandwidth_gbps * 1e9 * s.gpu_bw_eff),
                   flops / (s.gpu_bf16_tflops * 1e12 * s.gpu_flops_eff)) + launches * s.gpu_launch_overhead_s

    def h2d(self, nbytes: float) -> float:
        s = self.spec
        if s.pcie_h2d_gbps <= 0:
            raise ValueError("this environment has no PCIe link (pcie.h2d_gbps is 0)")
        return nbytes / (s.pcie_h2d_gbps * 1e9 * s.pcie_eff) + s.pcie_latency_s

    def d2h(self, nbytes: float) -> float:
        s = self.spec
        rate = s.pcie_d2h_gbps or s.pcie_h2d_gbps
        if rate <= 0:
            raise ValueError("this environment has no PCIe link (pcie.d2h_gbps and h2d_gbps are 0)")
        return nbytes / (rate * 1e9 * s.pcie_eff) + s.pcie_latency_s

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"spec": asdict(self.spec), "efficiency": self.eff.to_dict(), "threads": self.threads,
                "cpu_read_limit_gbps": self.limit_gbps, "cpu_read_limit_source": self.limit_source}
