"""The quantized CPU kernel (llama.cpp's Q8_0 / Q4_0, fiddler.kernels.quant) on one Mixtral-8x7B expert
(4096 x 14336: 187 MB at Q8_0, 99 MB at Q4_0) at one token, against the independent read limit measured
in the same rounds, in the mode this CPU uses by default. Like the engine, every call streams its
expert from DRAM (the copies exceed the caches).
"""
from __future__ import annotations

import pytest
import torch

import fiddler.kernels as fk

from .conftest import interleaved, record_ratio

HIDDEN, FFN = 4096, 14336
LIMIT_BYTES = 1 << 30


@pytest.fixture(scope="module")
def limit_buf():
    if not fk.is_available():
        pytest.skip(f"kernel library not available: {fk.load_error()}")
    return fk.limit_buffer(LIMIT_BYTES)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quant_kernel(benchmark, limit_buf, rounds, fmt):
    from fiddler.kernels import quant as fq

    g = torch.Generator().manual_seed(0)
    e0 = fq.QuantExpert.from_float(torch.randn(FFN, HIDDEN, generator=g) * HIDDEN**-0.5,
                                   torch.randn(FFN, HIDDEN, generator=g) * HIDDEN**-0.5,
                                   torch.randn(HIDDEN, FFN, generator=g) * FFN**-0.5, fmt)
    w13, w2 = e0.packed()
    copies = max(2, min(24, -(-fk.stream_working_set_bytes() // e0.nbytes)))
    experts = [e0] + [fq.QuantExpert.from_packed(fmt, HIDDEN, FFN, w13, w2) for _ in range(copies - 1)]
    x = torch.randn(1, HIDDEN, generator=g).to(torch.bfloat16)
    out = torch.empty(1, HIDDEN, dtype=torch.bfloat16)

    def limit(i):
        return e0.nbytes / (fk.read_limit(repeats=1, buffer=limit_buf)["gbps"] * 1e9)

    best = interleaved(benchmark, {
        "limit_s": limit,
        "kernel_s": lambda i: experts[i % copies].forward(x, out=out),
    }, 6 * rounds, warmup=3)  # calls of a few ms: many rounds cost little and steady the ratio
    mode = fq.mode()
    record_ratio(benchmark, f"quant_{fmt}_vs_limit_t1", best["limit_s"] / best["kernel_s"], "higher", best,
                 f"{fmt} expert GB/s / independent read limit GB/s, 1 token ({mode['mode']} on {mode['isa']})",
                 path=f"{mode['isa']}:{mode['mode']}", weight_bytes=e0.nbytes)
