import os, time, torch
from fiddler import Engine
from fiddler import kernels as K
path = "/root/.cache/fiddler/models/small_mixtral-d3e36049b2"
eng = Engine.from_pretrained(path, cpu_threads=2, max_seq_len=128, max_batch=16)
P = eng.executor.packed
L = len(P)
ebytes = sum(t.numel() * t.element_size() for t in P[0][0].packed())
x = torch.randn(16, 2048).to(torch.bfloat16)
y = torch.empty_like(x)
lim = K.read_limit(threads=2)["gbps"]
for rnd in range(2):
    for n in (1, 2, 3, 4, 8, 16):
        ts = []
        for r in range(3):
            t0 = time.perf_counter()
            for l in range(L):
                for e in range(8):
                    P[l][e].forward(x[:n], out=y[:n], threads=2)
            ts.append(time.perf_counter() - t0)
        b = min(ts)
        print(f"tokens {n}: {L*8*ebytes/b/1e9:.1f} GB/s = {L*8*ebytes/b/1e9/lim:.3f} of {lim:.1f}", flush=True)
print(K.features() if hasattr(K, "features") else "")
