"""Efficiency factors of the simulator: what fraction of a spec-sheet peak real code reaches, one set per
hardware class, each with where it came from.

A CPU class says how fast *our* kernel streams weights relative to the machine's read limit
(`fiddler.kernels.read_limit`, the independent limit), how fast bf16 GEMMs run per core at prefill
sizes, and how much of the spec sheet's theoretical DRAM bandwidth the read limit is (used only for
described environments: `environment=local`'s bandwidth is already the measured limit). A GPU class
says the same of the GPU. Every factor can be overridden (`Efficiency.with_overrides`) within its range
(`FACTOR_RANGES`, one table with the reasons); none is fitted to a table cell.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class CpuClass:
    name: str
    #: fiddler's CPU kernel at 1 token: GB/s read / the independent read limit
    kernel_bw_fraction: float
    #: bf16 GEMM at prefill sizes (torch/oneDNN or our kernel, whichever the engine uses), GFLOP/s per core;
    #: the time of a CPU matmul is bytes / (limit x kernel_bw_fraction) + FLOPs / (cores x this)
    gemm_gflops_per_core: float
    #: the read limit / the theoretical DRAM bandwidth of the spec sheet (described environments only)
    limit_of_theoretical: float
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuClass:
    name: str
    bw_fraction: float  # achieved / spec memory bandwidth, weight-streaming kernels
    flops_fraction: float  # achieved / spec dense bf16 tensor FLOP/s, GEMMs of MoE sizes
    launch_s: float  # floor of one kernel launch
    #: host-side time per decoder layer and step of fiddler's engine on a GPU (Python dispatch, streams,
    #: events): the floor of a layer's GPU-side work
    engine_layer_overhead_s: float
    #: the same floor for transformers' eager Mixtral (systems built on it: DeepSpeed, Mixtral-Offloading's
    #: released code)
    hf_layer_overhead_s: float
    #: the released Fiddler's cost per decoder layer and step outside its experts (efeslab/fiddler@227715b
    #: mixtral_forward under transformers 4.36.2: norms, attention, router, and its plan's torch.where per expert
    #: and Python brute force); system=fiddler_original
    release_layer_overhead_s: float
    pcie_fraction: float  # achieved / the environment's PCIe number (already pinned-copy rates: 1.0)
    pcie_latency_s: float
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FactorRange:
    """Where an efficiency factor may lie: [low, high], or (low, high] where `low_open`, and why."""

    low: float
    high: float
    why: str
    low_open: bool = True

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high  # NaN: False

    def allowed(self) -> str:
        return f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]: {self.why}"


# The range of every factor, checked for the classes below (tests/test_sim_inputs.py) and for every override
# (sim.efficiency at start, Efficiency.with_overrides). A factor of 0 divides by zero, a negative one gives
# negative durations, an inf or a huge one makes that work free: all gave `ok` records of nonsense.
_FRACTION = "a fraction of the peak it multiplies, which real code cannot exceed"
_FIXED_S = "seconds per launch or copy, 0 = none; microseconds in practice, 10 ms would be a stalled device"
_LAYER_S = ("seconds per decoder layer and step, 0 = none; the measured ones are 1.2-1.7 ms, 0.1 s would make "
            "a 32-layer step take 3 s of overhead alone")
FACTOR_RANGES: dict[str, FactorRange] = {
    "cpu.kernel_bw_fraction": FactorRange(0.0, 1.0, "the kernel's reads as a fraction of the read limit, "
                                                    "the independent limit it is judged against"),
    "cpu.gemm_gflops_per_core": FactorRange(0.0, 10000.0, "GFLOP/s per core; 10000 is over 10x the AMX core "
                                                          "measured (930), above any CPU core's bf16 peak"),
    "cpu.limit_of_theoretical": FactorRange(0.0, 1.0, "the read limit as a fraction of the spec sheet's "
                                                      "theoretical DRAM bandwidth, which it cannot exceed"),
    "gpu.bw_fraction": FactorRange(0.0, 1.0, _FRACTION),
    "gpu.flops_fraction": FactorRange(0.0, 1.0, _FRACTION),
    "gpu.pcie_fraction": FactorRange(0.0, 1.0, "a fraction of the environment's PCIe rates, which are "
                                               "achieved pinned-copy rates already"),
    "gpu.launch_s": FactorRange(0.0, 0.01, _FIXED_S, low_open=False),
    "gpu.pcie_latency_s": FactorRange(0.0, 0.01, _FIXED_S, low_open=False),
    "gpu.engine_layer_overhead_s": FactorRange(0.0, 0.1, _LAYER_S, low_open=False),
    "gpu.hf_layer_overhead_s": FactorRange(0.0, 0.1, _LAYER_S, low_open=False),
    "gpu.release_layer_overhead_s": FactorRange(0.0, 0.1, _LAYER_S, low_open=False),
}


def factor_problem(key: str, value: Any) -> str | None:
    """What `key` ("cpu.kernel_bw_fraction", ...) allows, where `value` is not in its range; None when it is."""
    rng = FACTOR_RANGES[key]
    return None if rng.contains(value) else rng.allowed()


_SPR_KERNEL = ("results/regression/floors.yaml (avx512, quick): the median of the six Intel readings of "
               "kernel_vs_limit_t1 (0.84-0.91; kernel and read_limit interleaved, best of rounds); the one stream "
               "sweep results/measured/2026-12-01-intel-xeon-stream read 0.93, and the engine's experts in decode "
               "read 32.6 GB/s on small_mixtral against a limit of 36-38 GB/s (0.86-0.91) when this was set")

CPU_CLASSES: dict[str, CpuClass] = {
    "intel_sapphire_rapids": CpuClass(
        "intel_sapphire_rapids", kernel_bw_fraction=0.88, gemm_gflops_per_core=930.0, limit_of_theoretical=0.80,
        sources={
            "kernel_bw_fraction": _SPR_KERNEL,
            "gemm_gflops_per_core": "results/measured/2026-12-01-intel-xeon-gemm: torch bf16 F.linear (oneDNN, AMX) "
                                    "on a Mixtral w1 (14336x4096), 512 tokens, 2 threads: 1865 GFLOP/s; the sum "
                                    "model bytes/limit + FLOPs/rate reproduces 16-512 tokens within 15%",
            "limit_of_theoretical": "assumption (second-hand): published STREAM-class reads on one Sapphire Rapids "
                                    "socket reach about 80% of 8 x DDR5-4800",
        }),
    "amd_zen": CpuClass(
        "amd_zen", kernel_bw_fraction=0.97, gemm_gflops_per_core=580.0, limit_of_theoretical=0.85,
        sources={
            "kernel_bw_fraction": "results/measured/2026-11-29-small_mixtral-2core-epyc/bench_kernel.json: the "
                                  "kernel reads 1.01 (1 token) to 0.97 (4 tokens) of the probe on a Zen VM "
                                  "(commit 882f944's prefetch); the probe then shared the kernel's prefetch, so "
                                  "the lower value is used",
            "gemm_gflops_per_core": "same file, 128 tokens: 45.8 ms for 45.1 GFLOP + 352 MB at 50 GB/s -> "
                                    "1.16 TFLOP/s on 2 cores (AVX512-BF16 kernel, no AMX)",
            "limit_of_theoretical": "assumption: dual-channel DDR5 desktops read about 85% of theoretical",
        }),
    "intel_skylake_avx512": CpuClass(
        "intel_skylake_avx512", kernel_bw_fraction=0.85, gemm_gflops_per_core=40.0, limit_of_theoretical=0.80,
        sources={
            "kernel_bw_fraction": "assumption: no such CPU measured; the AVX-512 path without BF16 converts "
                                  "weights to fp32 (more instructions per byte), taken as the AVX2 path's 0.85",
            "gemm_gflops_per_core": "assumption: 2.6 GHz x 32 fp32 FLOP/cycle x 0.5 (bf16 converted to fp32)",
            "limit_of_theoretical": "assumption (second-hand): six-channel DDR4-2666 sockets stream about 80%",
        }),
    "avx2_desktop": CpuClass(
        "avx2_desktop", kernel_bw_fraction=0.85, gemm_gflops_per_core=60.0, limit_of_theoretical=0.85,
        sources={
            "kernel_bw_fraction": "results/measured/2026-12-01-intel-xeon-small_mixtral-3systems/"
                                  "regress-quick-forced-avx2.txt: the AVX2 kernel reads 0.85 of the limit at 1 "
                                  "token (forced on the Intel VM)",
            "gemm_gflops_per_core": "assumption: 4 GHz x 32 fp32 FLOP/cycle (2 x 256-bit FMA) x 0.5 with bf16 "
                                    "converted to fp32 -> about 60",
            "limit_of_theoretical": "assumption: dual-channel DDR4 desktops read about 85% of theoretical",
        }),
}

_H200 = "results/measured/2026-11-29-h200-device-check/bench.txt"
_H200_HF = "results/measured/2026-12-04-h200-hf-layer-overhead"

GPU_CLASSES: dict[str, GpuClass] = {
    "nvidia": GpuClass(
        "nvidia", bw_fraction=0.80, flops_fraction=0.60, launch_s=1e-5, engine_layer_overhead_s=1.2e-3,
        hf_layer_overhead_s=1.7e-3, release_layer_overhead_s=1.644e-3, pcie_fraction=1.0, pcie_latency_s=1e-5,
        sources={
            "bw_fraction": "assumption (second-hand): memory-bound GEMV kernels reach 75-90% of the spec bandwidth",
            "flops_fraction": "assumption: cuBLAS bf16 GEMMs of 4096x14336 at tens to thousands of rows, 50-70% of "
                              "the dense tensor peak",
            "launch_s": "CUDA kernel launch plus PyTorch dispatch, about 10 us",
            "engine_layer_overhead_s": f"{_H200}: fiddler on small_mixtral (8 layers) with every expert resident "
                                       "decodes 98.7 tok/s on an H200 = 10.1 ms per step, of which the weights "
                                       "are 0.4 ms at the H200's bandwidth -> about 1.2 ms per layer and step",
            "hf_layer_overhead_s": f"{_H200}: transformers on the same model decodes 72.0 tok/s = 13.9 ms per step "
                                   "-> about 1.7 ms per layer and step",
            "release_layer_overhead_s": f"{_H200_HF}/hf436_8x7b.json: the released mixtral_forward's module calls "
                                        "and plan (experts skipped) under transformers 4.36.2 at Mixtral-8x7B's "
                                        "dims on an H200 with a 16-core Xeon host, 1.644 ms per layer and step "
                                        "(median; 1.632 at small_mixtral's dims); of which the plan's torch.where "
                                        "and Python brute force 0.84",
            "pcie_fraction": "the environments' PCIe numbers are pinned-copy rates already",
            "pcie_latency_s": "cudaMemcpyAsync issue latency, about 10 us",
        }),
}


def cpu_class_of(name: str, isa: str, has_amx: bool | None = None) -> str:
    """The CPU class of an environment's CPU, from its name and ISA (override with sim.cpu_class)."""
    n = (name or "").lower()
    if "epyc" in n or "ryzen" in n or "amd" in n:
        return "amd_zen"
    if isa == "avx2":
        return "avx2_desktop"
    if isa == "avx512":
        return "intel_skylake_avx512"
    if has_amx is False:
        return "amd_zen"  # AVX512-BF16 without AMX: Zen 4/5 (Cooper Lake aside)
    return "intel_sapphire_rapids"


@dataclass(frozen=True)
class Efficiency:
    cpu: CpuClass
    gpu: GpuClass
    overrides: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_classes(cls, cpu_class: str, gpu_class: str = "nvidia") -> Efficiency:
        if cpu_class not in CPU_CLASSES:
            raise ValueError(f"unknown CPU class {cpu_class!r}; known: {sorted(CPU_CLASSES)}")
        if gpu_class not in GPU_CLASSES:
            raise ValueError(f"unknown GPU class {gpu_class!r}; known: {sorted(GPU_CLASSES)}")
        return cls(CPU_CLASSES[cpu_class], GPU_CLASSES[gpu_class])

    def with_overrides(self, overrides: dict[str, Any] | None) -> Efficiency:
        """Overrides as {"cpu.kernel_bw_fraction": 0.9, "gpu.bw_fraction": 0.85, ...}."""
        if not overrides:
            return self
        cpu, gpu = self.cpu, self.gpu
        for key, value in overrides.items():
            part, _, name = key.partition(".")
            target = {"cpu": cpu, "gpu": gpu}.get(part)
            if target is None or name not in {f.name for f in fields(target)} or name in ("name", "sources"):
                raise ValueError(f"unknown efficiency factor {key!r}; use cpu.<factor> or gpu.<factor> of "
                                 f"{[f.name for f in fields(CpuClass)][1:-1]} / {[f.name for f in fields(GpuClass)][1:-1]}")
            problem = factor_problem(key, value)
            if problem:
                raise ValueError(f"efficiency factor {key}={value!r} is out of range; allowed: {problem}")
            sources = {**target.sources, name: f"override ({value})"}
            target = replace(target, **{name: float(value)}, sources=sources)
            if part == "cpu":
                cpu = target
            else:
                gpu = target
        return Efficiency(cpu, gpu, {**self.overrides, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": asdict(self.cpu), "gpu": asdict(self.gpu), "overrides": dict(self.overrides)}
