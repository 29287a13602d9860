"""Latency model of one expert: cpu(s), gpu(s) for s tokens and the transfer time of one expert.

- cpu(s) = cpu_a * s + cpu_b (the paper's linear model: b is streaming the weights, a the per-token
  compute and activation copies).
- gpu(s) = max(gpu_floor, gpu_a * s + gpu_b): memory-bound (flat) for few tokens, compute-bound beyond.
  A plain line (gpu_floor = 0) is the special case.
- transfer() = seconds to copy one expert's weights host -> device.

Two ways to get one: `calibrate` times the executor's real code paths (fitting the curves to raw samples,
which are kept for the record), or `LatencyModel.from_hardware_spec` derives the same parameters from
a HardwareSpec (bandwidths, TFLOP/s, cores, ISA, efficiency factors) for the simulator; the harness
builds that from its environment config (runners/hardware.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch


@dataclass
class LatencyModel:
    cpu_a: float
    cpu_b: float
    gpu_a: float
    gpu_b: float
    transfer_s: float
    gpu_floor: float = 0.0
    source: str = "manual"  # "calibrated" | "hardware_spec" | "manual"
    meta: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, Any] = field(default_factory=dict)  # raw measurements behind a calibrated model

    def cpu(self, s: float) -> float:
        return self.cpu_a * s + self.cpu_b if s > 0 else 0.0

    def gpu(self, s: float) -> float:
        return max(self.gpu_floor, self.gpu_a * s + self.gpu_b) if s > 0 else 0.0

    def transfer(self) -> float:
        return self.transfer_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LatencyModel:
        return cls(**d)

    @classmethod
    def manual(cls, cpu: tuple[float, float], gpu: tuple[float, float], transfer: float,
               gpu_floor: float = 0.0) -> LatencyModel:
        """A hand-made model (tests, what-if studies): cpu=(a, b), gpu=(a, b), transfer seconds."""
        return cls(cpu[0], cpu[1], gpu[0], gpu[1], transfer, gpu_floor, source="manual")

    @classmethod
    def from_hardware_spec(cls, spec: HardwareSpec, config, dtype: torch.dtype = torch.bfloat16,
                           cpu_threads: int | None = None, quant: str | None = None) -> LatencyModel:
        """Costs of one expert of `config` on the machine `spec` describes (no measurement); quant: the
        expert is held, streamed and copied as llama.cpp blocks (fiddler.quant)."""
        size = dtype.itemsize
        wbytes = config.expert_bytes(dtype, quant)
        flops_tok = 2 * 3 * config.hidden_size * config.intermediate_size
        act_bytes_tok = config.hidden_size * size  # one row each way for a CPU expert
        threads = cpu_threads or spec.cpu_threads or spec.cpu_cores
        cpu_flops = threads * spec.cpu_ghz * 1e9 * spec.cpu_flops_per_cycle() * spec.cpu_flops_eff
        cpu_bw = spec.cpu_mem_bandwidth_gbps * 1e9 * spec.cpu_bw_eff
        if spec.gpu_mem_bandwidth_gbps > 0 and spec.pcie_h2d_gbps <= 0:  # the copies below divide by it
            raise ValueError("HardwareSpec describes a GPU (gpu_mem_bandwidth_gbps > 0) but no PCIe link "
                             "(pcie_h2d_gbps is 0); give its rate")
        pcie_h2d = spec.pcie_h2d_gbps * 1e9 * spec.pcie_eff
        pcie_d2h = (spec.pcie_d2h_gbps or spec.pcie_h2d_gbps) * 1e9 * spec.pcie_eff
        cpu_a = flops_tok / cpu_flops
        if spec.gpu_mem_bandwidth_gbps > 0:
            cpu_a += act_bytes_tok / pcie_d2h + act_bytes_tok / pcie_h2d
        cpu_b = wbytes / cpu_bw + spec.cpu_call_overhead_s
        if spec.gpu_mem_bandwidth_gbps > 0 and spec.gpu_bf16_tflops > 0:
            gpu_a = flops_tok / (spec.gpu_bf16_tflops * 1e12 * spec.gpu_flops_eff)
            gpu_b = spec.gpu_launch_overhead_s
            gpu_floor = wbytes / (spec.gpu_mem_bandwidth_gbps * 1e9 * spec.gpu_bw_eff) + spec.gpu_launch_overhead_s
            transfer = wbytes / pcie_h2d + spec.pcie_latency_s
        else:  # no GPU: GPU-side options must never look attractive
            gpu_a, gpu_b, gpu_floor, transfer = 0.0, float("inf"), float("inf"), float("inf")
        return cls(cpu_a, cpu_b, gpu_a, gpu_b, transfer, gpu_floor, source="hardware_spec",
                   meta={"spec": asdict(spec), "dtype": str(dtype), "expert_bytes": wbytes,
                         "flops_per_token": flops_tok, "cpu_threads": threads})


# FLOPs per cycle per core for an expert GEMM on each ISA path, assuming one 512-bit (or two 256-bit)
# FMA pipe busy: vdpbf16ps does 32 bf16 multiply-adds; AVX-512 without BF16 converts to fp32 (16 lanes);
# AVX2 has 8 fp32 lanes x 2 pipes. Override with HardwareSpec.cpu_flops_per_cycle_override.
_FLOPS_PER_CYCLE = {"avx512_bf16": 64.0, "avx512": 32.0, "avx2": 32.0, "amx": 512.0}


@dataclass
class HardwareSpec:
    """What the latency model needs to know about a machine. Efficiency factors are the fraction of each
    peak the real kernels reach; they are assumptions until checked against measurements."""

    gpu_mem_bandwidth_gbps: float
    gpu_bf16_tflops: float
    pcie_h2d_gbps: float
    cpu_mem_bandwidth_gbps: float
    cpu_cores: int
    cpu_isa: str = "avx512_bf16"
    pcie_d2h_gbps: float = 0.0  # 0 = same as h2d
    cpu_threads: int | None = None
    cpu_ghz: float = 2.5
    cpu_flops_per_cycle_override: float | None = None
    cpu_bw_eff: float = 0.8
    cpu_flops_eff: float = 0.5
    gpu_bw_eff: float = 0.8
    gpu_flops_eff: float = 0.5
    pcie_eff: float = 1.0  # environment PCIe numbers are already achieved pinned-copy rates
    gpu_launch_overhead_s: float = 2e-5
    cpu_call_overhead_s: float = 2e-5
    pcie_latency_s: float = 1e-5

    def __post_init__(self) -> None:
        # an inf or NaN here came out of the latency model as NaN costs, and a negative one as negative
        # durations, far from the number that caused them
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"HardwareSpec.{f.name}={v!r} is invalid; allowed: a finite number >= 0")

    def cpu_flops_per_cycle(self) -> float:
        if self.cpu_flops_per_cycle_override is not None:
            return self.cpu_flops_per_cycle_override
        if self.cpu_isa not in _FLOPS_PER_CYCLE:
            raise ValueError(f"unknown cpu_isa {self.cpu_isa!r}; known: {sorted(_FLOPS_PER_CYCLE)}")
        return _FLOPS_PER_CYCLE[self.cpu_isa]


# ---------------------------------------------------------------- fitting

def _median(xs: Sequence[float]) -> float:
    v = sorted(xs)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def fit_linear(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """t = a*s + b by Theil-Sen (median of pairwise slopes, median intercept): timings on a shared machine
    have one-sided outliers (preemption) that would drag a least-squares line. a, b >= 0."""
    pts = [(float(s), float(t)) for s, t in points]
    if not pts:
        raise ValueError("no samples to fit")
    slopes = [(t2 - t1) / (s2 - s1) for i, (s1, t1) in enumerate(pts) for s2, t2 in pts[i + 1:] if s2 != s1]
    a = max(0.0, _median(slopes)) if slopes else 0.0
    b = _median([t - a * s for s, t in pts])
    if b < 0:  # through the origin
        b = 0.0
        a = _median([t / s for s, t in pts if s > 0])
    return a, b


def fit_roofline(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Fit t = max(floor, a*s + b): try every split of the samples (sorted by s) into a flat head (its
    median) and a linear tail (`fit_linear`), keep the split with the smallest summed absolute relative
    error. Returns (a, b, floor)."""
    pts = sorted((float(s), float(t)) for s, t in points)
    best = None
    for k in range(len(pts) - 1):
        head, tail = pts[:k], pts[k:]
        floor = _median([t for _, t in head]) if head else 0.0
        a, b = fit_linear(tail)
        err = sum(abs(max(floor, a * s + b) - t) / t for s, t in pts if t > 0)
        if best is None or err < best[0] - 1e-9:  # a floor must earn its place: ties keep the plain line
            best = (err, a, b, floor)
    if best is None:  # a single sample: flat
        return 0.0, 0.0, pts[0][1]
    return best[1], best[2], best[3]


# ---------------------------------------------------------------- calibration

_CACHE: dict[Any, LatencyModel] = {}


def best_time(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """Best-of-`repeats` wall time of fn() (fn must synchronise any asynchronous device work itself):
    fiddler.kernels.timing's, imported here when used (importing the kernels loads their library)."""
    from .kernels.timing import best_time as best

    return best(fn, repeats, warmup)


def calibrate(cpu_fn: Callable[[int], Any], gpu_fn: Callable[[int], Any], copy_fn: Callable[[], Any], *,
              token_counts: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 3,
              cache_key: Any = None, meta: dict[str, Any] | None = None) -> LatencyModel:
    """Measure the executor's real paths: cpu_fn(s) / gpu_fn(s) run one expert on s tokens, copy_fn()
    copies one expert's weights into the device buffer. Results are cached per `cache_key` (the executor
    passes (shape, dtype, device, threads)) for the life of the process."""
    if cache_key is not None and cache_key in _CACHE:
        return _CACHE[cache_key]
    t_start = time.perf_counter()
    counts = sorted({int(s) for s in token_counts if s > 0})
    cpu_pts = [(s, best_time(lambda s=s: cpu_fn(s), repeats)) for s in counts]
    gpu_pts = [(s, best_time(lambda s=s: gpu_fn(s), repeats)) for s in counts]
    copy_ts = []
    copy_fn()  # warm-up
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy_fn()
        copy_ts.append(time.perf_counter() - t0)
    cpu_a, cpu_b = fit_linear(cpu_pts)
    gpu_a, gpu_b, gpu_floor = fit_roofline(gpu_pts)
    lm = LatencyModel(cpu_a, cpu_b, gpu_a, gpu_b, min(copy_ts), gpu_floor, source="calibrated",
                      meta={**(meta or {}), "repeats": repeats, "statistic": "min",
                            "calibration_s": time.perf_counter() - t_start},
                      samples={"cpu": cpu_pts, "gpu": gpu_pts, "transfer": copy_ts})
    if cache_key is not None:
        _CACHE[cache_key] = lm
    return lm


def clear_cache() -> None:
    _CACHE.clear()
