"""Prefill A/B on one engine: who serves the linears (kernel, or torch beyond the measured crossover) x torch threads
(1, or the engine's cores). Rounds alternate ABCD / DCBA. ROUNDS=5 python ab_linears.py 512 1024"""
import os, sys, time, torch
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from runners.models import synthetic_model
from fiddler import Engine
from fiddler.threads import torch_threads
path = synthetic_model("small_mixtral")
e = Engine.from_pretrained(path, cpu_threads=2, max_seq_len=4100, max_batch=1)
m = e.model
kmt = m.layers[0].o_proj.kernel_max_tokens
print("measured kernel_max_tokens", kmt, "threads", m.torch_linear_threads, flush=True)
cfgs = {"A old(kernel,1thr)": (1 << 29, None), "B new": (kmt, 2), "C kernel,2thr": (1 << 29, 2), "D torch,1thr": (kmt, None)}
g = torch.Generator().manual_seed(0)
for n in [int(a) for a in sys.argv[1:]]:
    ids = torch.randint(0, 32000, (n,), generator=g)
    res = {k: [] for k in cfgs}
    for r in range(int(os.environ.get("ROUNDS", 3))):
        for k, (mt, th) in (cfgs.items() if r % 2 == 0 else reversed(list(cfgs.items()))):
            for lin in m.linears():
                lin.kernel_max_tokens = mt
            m.torch_linear_threads = th
            with torch_threads(e._torch_threads):
                t = time.perf_counter(); m.forward(ids[None], 0); res[k].append(time.perf_counter() - t)
    print(n, {k: f"best {min(v)*1e3:.0f} med {sorted(v)[len(v)//2]*1e3:.0f}" for k, v in res.items()}, flush=True)
