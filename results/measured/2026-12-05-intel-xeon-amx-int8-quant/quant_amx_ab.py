"""AMX-INT8 tiles vs the AVX-512 VNNI kernel on a Mixtral-8x7B expert, interleaved in one process."""
import sys, time, torch
import fiddler.kernels as fk
from fiddler.kernels import quant as fq
H, F = 4096, 14336
fmts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["q4_0", "q8_0"]
toks = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 3, 4, 8, 16]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
for fmt in fmts:
    g = torch.Generator().manual_seed(0)
    e0 = fq.QuantExpert.from_float(torch.randn(F, H, generator=g) * H**-0.5, torch.randn(F, H, generator=g) * H**-0.5,
                                   torch.randn(H, F, generator=g) * F**-0.5, fmt)
    w13, w2 = e0.packed()
    ex = [e0] + [fq.QuantExpert.from_packed(fmt, H, F, w13, w2) for _ in range(7)]
    for T in toks:
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        out = torch.empty(T, H, dtype=torch.bfloat16)
        best = {"off": 1e9, "on": 1e9}
        i = 0
        for r in range(rounds):
            for s in ("off", "on"):
                fq.set_amx(s, min_tokens=1)
                for _ in range(3):
                    t0 = time.perf_counter(); ex[i % len(ex)].forward(x, out=out); dt = time.perf_counter() - t0
                    i += 1
                    best[s] = min(best[s], dt)
        gb = e0.nbytes / 1e9
        print(f"{fmt} T={T:3d}  vector {best['off']*1e3:7.2f} ms ({gb/best['off']:5.1f} GB/s)  amx {best['on']*1e3:7.2f} ms ({gb/best['on']:5.1f} GB/s)  amx/vector speed {best['off']/best['on']:.2f}x", flush=True)
