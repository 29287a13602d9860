import time, torch, sys
import fiddler.kernels as fk
from fiddler.kernels import quant as fq
L = fk._L() if hasattr(fk, "_L") else None
from fiddler.kernels import _L
print("qamx", _L().fk_qamx_min_tokens(), _L().fk_qamx_status().decode(), fq.mode())
H, F = 4096, 14336
g = torch.Generator().manual_seed(0)
w1 = (torch.randn(F, H, generator=g) / H**0.5); w3 = (torch.randn(F, H, generator=g) / H**0.5); w2 = (torch.randn(H, F, generator=g) / F**0.5)
toks = [int(t) for t in sys.argv[1:]] or [1, 4, 16]
for fmt in ("q8_0", "q4_0"):
    e = [fq.QuantExpert.from_float(w1, w3, w2, fmt)]
    e0 = e[0]
    exps = [e0] + [fq.QuantExpert.from_packed(fmt, H, F, *[t.clone() for t in e0.packed()]) for _ in range(4)]
    for T in toks:
        x = torch.randn(T, H, generator=g).bfloat16()
        outs = {}
        best = {0: 1e9, 1: 1e9}
        for r in range(5):
            for on in (0, 1):
                _L().fk_set_qamx(-1 if on else 0)
                for i in range(len(exps)):
                    t0 = time.perf_counter(); y = exps[i % len(exps)].forward(x); dt = time.perf_counter() - t0
                    best[on] = min(best[on], dt)
                outs[on] = y
        same = torch.equal(outs[0], outs[1])
        print(f"{fmt} T={T} vnni {best[0]*1e3:.2f} ms  amx {best[1]*1e3:.2f} ms  x{best[0]/best[1]:.2f}  bits-equal={same}", flush=True)
