"""Best time of one Mixtral-8x7B expert (4096 x 14336) in Q8_0 and Q4_0 on the quantized kernel's default
path, at several token counts, every call streaming its expert from DRAM (copies cycled past
fiddler.kernels.stream_working_set_bytes). Prints one JSON line. Run with PYTHONPATH set to the tree to
measure (README.md here: the two trees alternated)."""
import json
import sys
import time

import torch

import fiddler.kernels as fk
from fiddler.kernels import quant as fq

H, F = 4096, 14336
tokens = [int(t) for t in sys.argv[1:]] or [1, 4, 16, 64, 256]
out = {"path": None, "ms": {}}
for fmt in ("q4_0", "q8_0"):
    g = torch.Generator().manual_seed(0)
    e0 = fq.QuantExpert.from_float(torch.randn(F, H, generator=g) * H**-0.5, torch.randn(F, H, generator=g) * H**-0.5,
                                   torch.randn(H, F, generator=g) * F**-0.5, fmt)
    w13, w2 = e0.packed()
    n = max(2, min(24, -(-fk.stream_working_set_bytes() // e0.nbytes)))
    experts = [e0] + [fq.QuantExpert.from_packed(fmt, H, F, w13, w2) for _ in range(n - 1)]
    for t in tokens:
        x = torch.randn(t, H).to(torch.bfloat16)
        y = torch.empty(t, H, dtype=torch.bfloat16)
        best = float("inf")
        for i in range((4 if t <= 16 else 2) * n):
            t0 = time.perf_counter()
            experts[i % n].forward(x, out=y)
            best = min(best, time.perf_counter() - t0)
        out["ms"][f"{fmt}_t{t}"] = round(best * 1e3, 3)
m = fq.mode()
out["path"] = f"{m['isa']}:{m['mode']}"
print(json.dumps(out))
