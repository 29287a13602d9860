"""The quantized CPU kernel (llama.cpp's Q8_0 / Q4_0, fiddler.kernels.quant) on one Mixtral-8x7B expert
(4096 x 14336: 187 MB at Q8_0, 99 MB at Q4_0) at 1, 4 and 16 tokens, in the mode this CPU uses by
default: at one token against the independent read limit measured in the same rounds (read_limit's
strategies reading other copies of the same weights, one cold read a round: conftest.own_memory_limit), and at each
count against its roofline, max(bytes / read limit, operations / compute peak), with the compute peak
of this host for the format measured right after, best of rounds of its own (fiddler.kernels.roofline.PeakProbe:
the better of torch's int8 matmul and the kernel's own best), and beside it against the roofline with the
instruction set's own peak for the path (roofline.isa_peak: vpdpbusd or AMX-INT8 tiles on registers only,
quant_FMT_vs_isa_roofline_tN). Like the engine, every call streams its expert from
DRAM (the copies exceed the caches).
"""
from __future__ import annotations

import pytest
import torch

import fiddler.kernels as fk
from fiddler.kernels import roofline

from .conftest import interleaved, own_memory_limit, record_ratio

HIDDEN, FFN = 4096, 14336


@pytest.fixture(scope="module", params=["q8_0", "q4_0"])
def quant_experts(request):
    if not fk.is_available():
        pytest.skip(f"kernel library not available: {fk.load_error()}")
    from fiddler.kernels import quant as fq

    fmt = request.param
    g = torch.Generator().manual_seed(0)
    e0 = fq.QuantExpert.from_float(torch.randn(FFN, HIDDEN, generator=g) * HIDDEN**-0.5,
                                   torch.randn(FFN, HIDDEN, generator=g) * HIDDEN**-0.5,
                                   torch.randn(HIDDEN, FFN, generator=g) * FFN**-0.5, fmt)
    w13, w2 = e0.packed()
    copies = max(2, min(24, -(-fk.stream_working_set_bytes() // e0.nbytes)))
    experts = [e0] + [fq.QuantExpert.from_packed(fmt, HIDDEN, FFN, w13, w2) for _ in range(copies - 1)]
    return fmt, experts, roofline.PeakProbe(fmt)


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_quant_kernel(benchmark, quant_experts, rounds, tokens):
    from fiddler.kernels import quant as fq

    fmt, experts, peak = quant_experts
    e0, copies = experts[0], len(experts)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16)

    peak.reset()
    kind = roofline.isa_kind(fq.path(tokens, fmt))
    ops = roofline.expert_flops(HIDDEN, FFN, tokens)  # the probe runs the call's op count: it meets the same neighbours
    isa_side = {"isa_s_per_gop": lambda i: 1.0 / roofline.isa_peak(kind, repeats=1, ops=ops)} if kind else {}
    best = interleaved(benchmark, {
        "limit_s": own_memory_limit(experts, e0.nbytes),
        "kernel_s": lambda i: experts[i % copies].forward(x, out=out),
        **isa_side,
    }, (6 if tokens == 1 else 2) * rounds, warmup=3)  # calls of a few ms: many rounds cost little and steady the ratio
    # the compute peak right after, best of its own rounds (inside the rounds above it would run just
    # before the limit and the kernel of the next round and change what they read)
    peak_s = min(peak.best_s() for _ in range(rounds))
    common = dict(path=fq.path(tokens, fmt), weight_bytes=e0.nbytes, tokens=tokens,
                  pass_tokens=fq.pass_tokens()["tokens"])  # the per-CPU pass setting (9-16 tokens on VNNI)
    if tokens == 1:
        record_ratio(benchmark, f"quant_{fmt}_vs_limit_t1", best["limit_s"] / best["kernel_s"], "higher", best,
                     f"{fmt} expert GB/s / independent read limit GB/s, 1 token ({common['path']})",
                     **common)
    flops = roofline.expert_flops(HIDDEN, FFN, tokens)
    # the kernel's own best includes this call: a peak it beats would be no peak
    gops, peak_by = max((peak.flops / peak_s / 1e9, peak.winner()),
                       (flops / best["kernel_s"] / 1e9, f"kernel_expert_t{tokens}"))
    roof_s = roofline.roofline_s(e0.nbytes, flops, e0.nbytes / best["limit_s"] / 1e9, gops)
    record_ratio(benchmark, f"quant_{fmt}_vs_roofline_t{tokens}", roof_s / best["kernel_s"], "higher",
                 {**best, "peak_s": peak_s, "roofline_s": roof_s},
                 f"roofline time / {fmt} expert time, {tokens} token(s) ({common['path']}; compute peak "
                 f"{gops:.0f} GOP/s by {peak_by}, the best of {', '.join(peak.sources)} and this call)", peak_gops=gops,
                 peak_by=peak_by, flops=flops, **common)
    if kind is not None:  # beside it, the roofline with the instruction set's own peak (no kernel, no GEMM)
        isa = 1.0 / best["isa_s_per_gop"]
        isa_roof_s = roofline.roofline_s(e0.nbytes, flops, e0.nbytes / best["limit_s"] / 1e9, isa)
        record_ratio(benchmark, f"quant_{fmt}_vs_isa_roofline_t{tokens}", isa_roof_s / best["kernel_s"], "higher",
                     {**best, "roofline_s": isa_roof_s}, f"roofline time with the ISA peak ({kind} {isa:.0f} GOP/s) / "
                     f"{fmt} expert time, {tokens} token(s) ({common['path']})", isa_peak_gops=isa, isa_kind=kind,
                     flops=flops, **common)
