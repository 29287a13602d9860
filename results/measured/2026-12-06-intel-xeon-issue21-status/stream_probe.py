import time, torch
from fiddler import Engine
from fiddler import kernels as K
path = "/root/.cache/fiddler/models/small_mixtral-d3e36049b2"
eng = Engine.from_pretrained(path, cpu_threads=2, max_seq_len=128, max_batch=16)
P = eng.executor.packed
L = len(P)
ebytes = sum(t.numel() * t.element_size() for t in P[0][0].packed())
x = torch.randn(16, 2048).to(torch.bfloat16); y = torch.empty_like(x)
lim = K.read_limit(threads=2)["gbps"]
specs = ["t0:1024/4096", "t0:1024", "t0:2048", "t0:2048/8192", "t1:2048", "none"]
res = {(s, n): [] for s in specs for n in (1, 4, 16)}
for rnd in range(3):
    for s in specs:
        K.set_stream(s)
        for n in (1, 4, 16):
            t0 = time.perf_counter()
            for l in range(L):
                for e in range(8):
                    P[l][e].forward(x[:n], out=y[:n], threads=2)
            res[(s, n)].append(L * 8 * ebytes / (time.perf_counter() - t0) / 1e9)
for s in specs:
    print(s, " ".join(f"t{n}: {max(res[(s, n)]):.1f} ({max(res[(s, n)])/lim:.3f})" for n in (1, 4, 16)), f"limit {lim:.1f}")
