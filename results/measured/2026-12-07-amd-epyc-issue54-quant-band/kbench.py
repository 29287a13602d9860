"""Quantized expert kernel time of the tree on PYTHONPATH: one Mixtral-8x7B expert (4096 x 14336), copies
cycled through more memory than the LLC, at 1 / 4 / 16 tokens, best of rounds. Two clocks: wall (2 threads,
as the benchmark) and thread CPU time of a single-threaded call (threads=1: the caller is the only worker,
so time spent descheduled by neighbours is not counted). Prints one JSON line of ms per key."""
import json, sys, time
import torch
import fiddler.kernels as fk
from fiddler.kernels import quant as fq

H, F = 4096, 14336
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
g = torch.Generator().manual_seed(0)
w1 = torch.randn(F, H, generator=g) * H**-0.5
w3 = torch.randn(F, H, generator=g) * H**-0.5
w2 = torch.randn(H, F, generator=g) * F**-0.5
out = {}
for fmt in ("q8_0", "q4_0"):
    e0 = fq.QuantExpert.from_float(w1, w3, w2, fmt)
    a, b = e0.packed()
    n = max(2, -(-(400 << 20) // e0.nbytes))
    es = [e0] + [fq.QuantExpert.from_packed(fmt, H, F, a, b) for _ in range(n - 1)]
    for T in (1, 4, 16):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        y = torch.empty(T, H, dtype=torch.bfloat16)
        bw, bt = float("inf"), float("inf")
        i = 0
        for r in range(rounds + 1):
            for _ in range(3):
                t0 = time.perf_counter(); es[i % n].forward(x, out=y); w = time.perf_counter() - t0; i += 1
                c0 = time.thread_time_ns(); es[i % n].forward(x, out=y, threads=1); c = (time.thread_time_ns() - c0) / 1e9; i += 1
                if r:
                    bw, bt = min(bw, w), min(bt, c)
        out[f"{fmt}_t{T}_wall_ms"] = bw * 1e3
        out[f"{fmt}_t{T}_cpu1_ms"] = bt * 1e3
print(json.dumps(out))
