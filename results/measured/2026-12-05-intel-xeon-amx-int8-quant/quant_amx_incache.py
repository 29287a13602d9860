import sys, time, torch
from fiddler.kernels import quant as fq
N, K = 512, 4096
for fmt in sys.argv[1].split(","):
    lin = fq.QuantLinear.from_float(torch.randn(N, K) / 64, fmt)
    blocks = N // 16 * K // 32
    for T in [int(t) for t in sys.argv[2].split(",")]:
        x = torch.randn(T, K).to(torch.bfloat16)
        out = torch.empty(T, N, dtype=torch.bfloat16)
        res = {}
        for s in ("off", "on"):
            fq.set_amx(s, min_tokens=1)
            best = 1e9
            for _ in range(200):
                t0 = time.perf_counter(); lin.forward(x, out=out); best = min(best, time.perf_counter() - t0)
            res[s] = best
        # cycles per block per core at an assumed 2 threads
        print(f"{fmt} T={T:2d} in-cache: vector {res['off']*1e6:7.1f} us ({res['off']*1e9/(blocks/2):5.1f} ns/block/core)  amx {res['on']*1e6:7.1f} us ({res['on']*1e9/(blocks/2):5.1f} ns/block/core)")
