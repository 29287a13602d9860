import os, time, torch, statistics
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from fiddler import Engine
from fiddler import kernels as K
path = "/root/.cache/fiddler/models/small_mixtral-d3e36049b2"
eng = Engine.from_pretrained(path, cpu_threads=2, max_seq_len=128, max_batch=16)
ex = eng.executor
P = ex.packed
L = len(P)
g = torch.Generator().manual_seed(0)
sizes = [2, 2, 1, 1, 2]          # 8 slots of 4 beams x top-2 over 5 experts
experts = [0, 2, 3, 5, 7]
T = sum(sizes)
x = torch.randn(T, 2048, generator=g).to(torch.bfloat16)
y = torch.empty_like(x)
ebytes = sum(t.numel() * t.element_size() for t in P[0][0].packed())
def per_expert(l):
    s = 0
    for e, n in zip(experts, sizes):
        P[l][e].forward(x[s:s+n], out=y[s:s+n], threads=2); s += n
def fused(l):
    xs = x[:2]
    K.moe_ffn([P[l][e] for e in experts], torch.ones(len(experts), dtype=torch.bfloat16), xs, threads=2)
for name, fn in [("per_expert", per_expert), ("moe_ffn_2tok", fused)] * 3:
    ts = []
    for r in range(3):
        t0 = time.perf_counter()
        for l in range(L): fn(l)
        ts.append(time.perf_counter() - t0)
    b = min(ts)
    print(f"{name}: {b*1e3:.1f} ms for {L} layers x {len(experts)} experts, {L*len(experts)*ebytes/b/1e9:.1f} GB/s", flush=True)
print("read limit", K.read_limit(threads=2))
