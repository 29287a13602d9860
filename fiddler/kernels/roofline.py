"""The compute side of the kernel's roofline: this host's GEMM peak, measured, never assumed.

A kernel call that reads `nbytes` of weights and does `flops` operations can take no less than
max(nbytes / read limit, flops / compute peak). The read limit is `fiddler.kernels.read_limit`; the
compute peak is the better of two measurements on matrices that stay in cache, so that memory plays
no part:
- torch's own GEMM (`F.linear` in bf16, `torch._int_mm` in int8: oneDNN, AMX tiles or AVX-512 / AVX2
  where the CPU has them), and
- the project's kernel at its most compute-bound (many tokens, the path this CPU runs: AMX tiles, AVX-512
  or AVX2 FMA; for Q8_0 / Q4_0 the quantized kernel's integer dot products).
A kernel that beats torch raises its own yardstick. `compute_peak()["best"]` says which source won.

`isa_peak(kind)` is the third, independent source: the dot-product instruction a path issues, on registers
only (csrc/fk_isa_peak.cpp), no loads, no kernel code. It bounds every kernel and torch's GEMM from above,
so a ratio against it (`isa_kind(path)` names the instruction of a recorded kernel path) judges the kernel
by what the CPU can issue, not by a GEMM that may be slower than the kernel it judges.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .timing import best_time

_N, _K, _M = 4096, 4096, 512  # 32 MiB of bf16 weights, 17 GFLOP a call: compute-bound on any CPU
_CACHE: dict = {}
KINDS = ("bf16", "q8_0", "q4_0")


def _best_s(fn, repeats: int) -> float:
    return best_time(fn, repeats=repeats, warmup=1)  # warm-up: first-touch, oneDNN's primitive cache, the pool


def _threads(threads: int | None) -> int:
    import fiddler.kernels as fk

    return threads or (fk.get_num_threads() if fk.is_available() else torch.get_num_threads())


class PeakProbe:
    """The sources of the compute peak for `kind`, built once (weights made and packed), measurable again
    and again: a benchmark measures them in the same rounds as the kernel, so a busy moment lowers both.
    `sources`: {name: fn() running one [512 x 4096] x [4096 x 4096] product}; `flops`: of one call."""

    def __init__(self, kind: str = "bf16", threads: int | None = None):
        import fiddler.kernels as fk

        if kind not in KINDS:
            raise ValueError(f"compute_peak: kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.threads = n = _threads(threads)
        self.flops = 2 * _M * _N * _K
        g = torch.Generator().manual_seed(0)
        w = torch.randn(_N, _K, generator=g) * _K**-0.5
        x = torch.randn(_M, _K, generator=g)
        self.sources: dict = {}
        if kind == "bf16":
            wb, xb = w.to(torch.bfloat16), x.to(torch.bfloat16)
            self.sources[f"torch_bf16_matmul_{n}t"] = self._torch(lambda: F.linear(xb, wb))
        else:
            a = torch.randint(-127, 128, (_M, _K), generator=g, dtype=torch.int8)
            b = torch.randint(-127, 128, (_N, _K), generator=g, dtype=torch.int8).t()  # [K, N], as _int_mm takes it
            fn = self._torch(lambda: torch._int_mm(a, b))
            try:
                fn()
                self.sources[f"torch_int8_matmul_{n}t"] = fn
            except RuntimeError:  # a torch build without a CPU int8 GEMM: the kernel alone is the peak
                pass
        if fk.is_available():
            xb = x.to(torch.bfloat16)
            out = torch.empty(_M, _N, dtype=torch.bfloat16)
            if kind == "bf16":
                lin = fk.PackedLinear(w.to(torch.bfloat16))
                feats = fk.features()
                path = feats["isa"] + ("+amx" if feats["amx_active"] and _M >= feats["amx_min_tokens"] else "")
            else:
                from fiddler.kernels import quant as fq

                lin = fq.QuantLinear.from_float(w, kind)
                path = fq.path(_M, kind)
            self.sources[f"kernel_{path}_{n}t"] = lambda: lin.forward(xb, out=out, threads=n)
        if not self.sources:
            raise RuntimeError(f"compute_peak({kind!r}): neither torch nor the kernel library can run it here")
        self.reset()

    def _torch(self, fn):
        def run():
            prev = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                return fn()
            finally:
                torch.set_num_threads(prev)
        return run

    def measure(self, repeats: int = 3) -> dict[str, float]:
        """GFLOP/s of each source, the best of `repeats` calls (after one warm-up)."""
        if repeats < 1:
            raise ValueError("compute_peak needs repeats >= 1")
        return {name: self.flops / _best_s(fn, repeats) / 1e9 for name, fn in self.sources.items()}

    def best_s(self) -> float:
        """One call of each source; the faster one's seconds (a benchmark side: its best over rounds
        gives the peak as `flops / best`). Each source's best since `reset()` is kept in `seen`."""
        for name, fn in self.sources.items():
            self.seen[name] = min(self.seen.get(name, float("inf")), _best_s(fn, 1))
        return min(self.seen.values())

    def reset(self) -> None:
        self.seen: dict[str, float] = {}

    def winner(self) -> str | None:
        """The source with the best time seen since `reset()`."""
        return min(self.seen, key=self.seen.get) if self.seen else None


def peak_of(kind: str, threads: int, sources: dict[str, float]) -> dict:
    """The peak dict of measured sources: the best one, named."""
    best = max(sources, key=sources.get)
    return {"gflops": sources[best], "best": best, "sources": dict(sources), "kind": kind, "threads": threads,
            "shape": [_M, _K, _N]}


def compute_peak(kind: str = "bf16", threads: int | None = None, repeats: int = 3, cached: bool = True) -> dict:
    """The GEMM peak of this host in GFLOP/s (int8: GOP/s, 2 per multiply-add) for `kind`: "bf16" (the
    yardstick of the bf16 expert kernel) or "q8_0" / "q4_0" (of the quantized kernel: torch's int8 matmul
    against that format's kernel). Each source is the best of `repeats` calls on a [512 x 4096] x
    [4096 x 4096] product at `threads` threads (default: the kernel's). Returns {"gflops", "best",
    "sources": {name: GFLOP/s}, "kind", "threads", "shape"}; measured once per process and argument set
    unless cached=False."""
    if kind not in KINDS:
        raise ValueError(f"compute_peak: kind must be one of {KINDS}, got {kind!r}")
    if repeats < 1:
        raise ValueError("compute_peak needs repeats >= 1")
    key = (kind, _threads(threads), repeats)
    if cached and key in _CACHE:
        return copy.deepcopy(_CACHE[key])
    probe = PeakProbe(kind, threads)
    out = peak_of(kind, probe.threads, probe.measure(repeats))
    if cached:
        _CACHE[key] = copy.deepcopy(out)
    return out


ISA_PEAK_KINDS = ("avx512_bf16", "avx512_vnni", "avx512_fma", "avx2_fma", "amx_bf16", "amx_int8")


def isa_kind(path: str) -> str | None:
    """The instruction a kernel path's products run on, from the path a benchmark records (`features()`'s
    isa plus "+amx" for the bf16 expert; `quant.path()` for Q8_0 / Q4_0, e.g. "avx512_vnni+amx:a8"): AMX
    tiles where "+amx", vdpbf16ps on avx512_bf16, vpdpbusd on avx512_vnni, FMA on zmm on the AVX-512 F bf16
    path and on ymm on the AVX2 one;
    None where no probe matches (the AVX2 and portable quantized paths, generic)."""
    isa, _, mode = path.partition(":")
    if isa.endswith("+amx"):
        return "amx_int8" if isa.startswith("avx512_vnni") else "amx_bf16"
    if isa in ("avx512_bf16", "avx512_vnni") and mode in ("", "a8"):
        return isa
    if mode:
        return None
    return {"avx512": "avx512_fma", "avx2": "avx2_fma"}.get(isa)


def isa_peak(kind: str, threads: int | None = None, repeats: int = 10, ops: float = 1e9) -> float:
    """GFLOP/s (int8: GOP/s, 2 per multiply-add) of `kind`'s instruction on registers only, at `threads`
    threads (default: the kernel's), the best of `repeats` runs of about `ops` operations each (at least 64
    loop iterations a thread). A benchmark gives it the op count of the call it judges: a run as long as
    that call meets the same neighbours on a shared machine, where a much shorter one finds the quiet
    moments the call does not. Raises RuntimeError where the library or the CPU cannot run it, ValueError
    for an unknown kind."""
    import fiddler.kernels as fk
    from ._lib import L, last_error

    if kind not in ISA_PEAK_KINDS:
        raise ValueError(f"isa_peak: kind must be one of {ISA_PEAK_KINDS}, got {kind!r}")
    if repeats < 1 or not ops > 0:
        raise ValueError("isa_peak needs repeats >= 1 and ops > 0")
    if not fk.is_available():
        raise RuntimeError(f"isa_peak: kernel library not available: {fk.load_error()}")
    v = L().fk_isa_peak(kind.encode(), _threads(threads), float(ops), repeats)
    if v < 0:
        raise RuntimeError(last_error())
    return float(v)


def roofline_s(nbytes: float, flops: float, gbps: float, gflops: float) -> float:
    """The least time a call can take: max(bytes / read limit, FLOPs / compute peak)."""
    if gbps <= 0 or gflops <= 0:
        raise ValueError(f"roofline_s needs a positive read limit and compute peak, got {gbps} GB/s, {gflops} GFLOP/s")
    return max(nbytes / (gbps * 1e9), flops / (gflops * 1e9))


def expert_flops(hidden: int, ffn: int, tokens: int) -> int:
    """Multiply-adds x 2 of one SwiGLU expert (w1, w3: ffn x hidden; w2: hidden x ffn) for `tokens` rows."""
    return 2 * 3 * hidden * ffn * tokens
