"""The CPU expert kernel on one Mixtral-8x7B expert (4096 x 14336, 352 MB bf16):
- against torch's bf16 expert on the same weights (speedup), at 1, 4, 16 and 64 tokens;
- against the independent read limit, measured in the same rounds: read_limit's strategies reading other
  copies of the same weights, one cold read a round (conftest.own_memory_limit), so that the limit reads
  memory as recently touched as the kernel's;
- against its roofline, max(bytes / read limit, FLOPs / compute peak), with the compute peak of this host
  measured right after, best of rounds of its own (fiddler.kernels.roofline.PeakProbe: the better of torch's bf16 matmul and the
  kernel's own best), at 1 to 512 tokens;
- against the instruction set's own peak (fiddler.kernels.roofline.isa_peak: the path's dot-product
  instruction on registers only, no kernel code), one short run a round beside the kernel: its FLOP/s over it at 64+
  tokens (kernel_vs_isa_peak_tN) and its roofline with that peak (kernel_vs_isa_roofline_tN), beside
  kernel_vs_roofline, whose peak includes the kernel's own best;
- the weight stream's active prefetch against the best candidate measured here at 1 token, which
  catches a per-CPU default that is wrong for this CPU.

Like the engine, which streams each expert from DRAM, every side cycles through enough weight
copies that no cache holds them between calls.
"""
from __future__ import annotations

import time

import pytest
import torch

import fiddler.kernels as fk
from fiddler.executors import ExpertWeights, torch_expert  # the library's SwiGLU in torch
from fiddler.kernels import roofline

from .conftest import interleaved, own_memory_limit, record_ratio

HIDDEN, FFN = 4096, 14336
TOKENS = (1, 4, 16, 64, 256, 512)
# From this many tokens the expert on vdpbf16ps alone (no AMX) is compute-bound: a bf16 expert does `tokens`
# FLOPs per weight byte, and these CPUs' compute over their read limit is a few FLOPs per byte (Zen 4, 2
# cores: 140 GFLOP/s over ~25 GB/s), so kernel_vs_limit there reads the compute peak, not the stream
# (0.09 at 64 tokens, 0.01 at 512 on an AMD EPYC family 25 model 17): reported, not floored. The AVX2 path
# (fp32 FMA on widened bf16, about 200 GFLOP/s on 2 cores over 25-40 GB/s) crosses at under 10 tokens: at 16
# it reads 0.18-0.21 of the limit and 0.88 of the roofline (AMD EPYC family 25 model 1; Intel forced avx2). The
# AVX-512 F path (the same FMA on zmm, ~2.4x the AVX2 path's rate) crosses at under 16 too.
COMPUTE_BOUND_FROM = {"avx512_bf16": 64, "avx512": 16, "avx2": 16}


@pytest.fixture(scope="module")
def experts():
    if not fk.is_available():
        pytest.skip(f"kernel library not available: {fk.load_error()}")
    g = torch.Generator().manual_seed(0)
    weight_bytes = 3 * HIDDEN * FFN * 2
    copies = max(2, min(16, -(-fk.stream_working_set_bytes() // weight_bytes)))
    torch_w, packed = [], []
    for _ in range(copies):
        w1 = (torch.randn(FFN, HIDDEN, generator=g) * HIDDEN**-0.5).to(torch.bfloat16)
        w3 = (torch.randn(FFN, HIDDEN, generator=g) * HIDDEN**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(HIDDEN, FFN, generator=g) * FFN**-0.5).to(torch.bfloat16)
        torch_w.append(ExpertWeights(w1, w3, w2))
        packed.append(fk.PackedExpert(w1, w3, w2))
    fk.tune_blocking(packed)  # as the engine does on its experts at load
    return torch_w, packed, weight_bytes


@pytest.fixture(scope="module")
def peak():
    return roofline.PeakProbe("bf16")


@pytest.mark.parametrize("tokens", TOKENS)
def test_kernel(benchmark, experts, peak, rounds, tokens):
    torch_w, packed, weight_bytes = experts
    n = len(packed)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16)
    torch.set_num_threads(fk.get_num_threads())

    flops = roofline.expert_flops(HIDDEN, FFN, tokens)

    # The kernel runs right after the limit's reads (not after a torch op, whose OpenMP threads
    # busy-wait for a while after a parallel region and would share the cores with it).
    peak.reset()
    feats = fk.features()
    path = feats["isa"] + ("+amx" if feats["amx_active"] and tokens >= feats["amx_min_tokens"] else "")
    best = interleaved(benchmark, {
        "limit_s": own_memory_limit(packed, weight_bytes),
        "kernel_s": lambda i: packed[i % n].forward(x, out=out),
        "torch_s": lambda i: torch_expert(torch_w[(i + 1) % n], x),
        **isa_side(path, flops),
    }, 2 * rounds, warmup=2)
    # the compute peak right after, best of its own rounds (inside the rounds above, its AMX/oneDNN work
    # would run just before the limit and the kernel of the next round and change what they read)
    peak_s = min(peak.best_s() for _ in range(rounds))
    common = dict(tokens=tokens, path=path, stream=feats["stream"], weight_bytes=weight_bytes,
                  blocking=fk.blocking_choice())
    # the roofline of the round with the best limit: max(its memory time, the compute peak's time)
    # the kernel's own best includes this call: a peak it beats would be no peak (the expert at 256-512
    # tokens has read faster than the probe's product)
    gflops, peak_by = max((peak.flops / peak_s / 1e9, peak.winner()),
                          (flops / best["kernel_s"] / 1e9, f"kernel_expert_t{tokens}"))
    roof_s = roofline.roofline_s(weight_bytes, flops, weight_bytes / best["limit_s"] / 1e9, gflops)
    record_ratio(benchmark, f"kernel_vs_roofline_t{tokens}", roof_s / best["kernel_s"], "higher",
                 {**best, "peak_s": peak_s, "roofline_s": roof_s},
                 f"roofline time / kernel time, {tokens} token(s) (compute peak {gflops:.0f} GFLOP/s by "
                 f"{peak_by}, the best of {', '.join(peak.sources)} and this call)", peak_gflops=gflops,
                 peak_by=peak_by, flops=flops, **common)
    record_ratio(benchmark, f"kernel_vs_torch_t{tokens}", best["torch_s"] / best["kernel_s"], "higher",
                 best, f"torch bf16 expert time / kernel time, {tokens} token(s)", **common)
    isa_ratios(benchmark, path, flops, weight_bytes, best, common)
    bound_from = COMPUTE_BOUND_FROM.get(path)
    report = {"report_only": f"compute-bound on {path} from {bound_from} tokens"} if bound_from and tokens >= bound_from else {}
    record_ratio(benchmark, f"kernel_vs_limit_t{tokens}", best["limit_s"] / best["kernel_s"], "higher",
                 best, f"kernel GB/s / independent read limit GB/s, {tokens} token(s)", **common, **report)


def isa_side(path: str, flops: float) -> dict:
    """The instruction set's peak for `path` as a side of the rounds ({} where no probe matches): one
    register-only run a round of the kernel call's own op count (no memory touched, so it leaves the
    kernel's and the limit's reads alone; as long as the call at the peak, so it meets the neighbours the
    call meets, where a 1 ms run caught quiet moments the call did not), in seconds per GFLOP."""
    kind = roofline.isa_kind(path)
    n = fk.get_num_threads()
    return {"isa_s_per_gflop": lambda i: 1.0 / roofline.isa_peak(kind, n, repeats=1, ops=flops)} if kind else {}


def isa_ratios(benchmark, path, flops, weight_bytes, best, common):
    """The kernel against the instruction set's peak for its path (measured in its rounds, isa_side): its
    roofline with that peak at every token count, and its share of the peak where the expert is
    compute-bound enough for it to mean something (64+ tokens)."""
    kind = roofline.isa_kind(path)
    if kind is None:
        return
    gflops = 1.0 / best["isa_s_per_gflop"]
    tokens = common["tokens"]
    roof_s = roofline.roofline_s(weight_bytes, flops, weight_bytes / best["limit_s"] / 1e9, gflops)
    extra = dict(isa_peak_gflops=gflops, isa_kind=kind, flops=flops, **common)
    record_ratio(benchmark, f"kernel_vs_isa_roofline_t{tokens}", roof_s / best["kernel_s"], "higher",
                 {**best, "roofline_s": roof_s}, f"roofline time with the ISA peak ({kind} {gflops:.0f} GFLOP/s) / "
                 f"kernel time, {tokens} token(s)", **extra)
    if tokens >= 64:
        record_ratio(benchmark, f"kernel_vs_isa_peak_t{tokens}", flops / best["kernel_s"] / 1e9 / gflops, "higher",
                     best, f"kernel GFLOP/s / ISA peak ({kind} {gflops:.0f} GFLOP/s), {tokens} token(s)", **extra)


def test_stream_choice(benchmark, experts, rounds):
    """At one token, the active stream prefetch against every candidate of tune_stream."""
    _, packed, weight_bytes = experts
    n = len(packed)
    x = torch.randn(1, HIDDEN).to(torch.bfloat16)
    out = torch.empty(1, HIDDEN, dtype=torch.bfloat16)
    active = fk.stream()
    spec = active["spec"]

    def with_stream(s):
        def side(i):
            fk.set_stream(s, source=active["source"])
            t = time.perf_counter()
            packed[i % n].forward(x, out=out)
            return time.perf_counter() - t
        return side

    sides = {"active_s": with_stream(spec)}
    sides.update({f"{c}_s": with_stream(c) for c in fk.TUNE_CANDIDATES if c != spec})
    try:  # calls of ~10 ms each: three times the rounds cost little and steady the ratio
        best = interleaved(benchmark, sides, 3 * rounds)
    finally:
        fk.set_stream(spec, source=active["source"])
    fastest = min(best.values())
    record_ratio(benchmark, "stream_choice_vs_best", fastest / best["active_s"], "higher", best,
                 f"best candidate's time / the active prefetch's ({spec}, {active['source']}) time, 1 token",
                 stream=active)
