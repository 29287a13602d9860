import os, time, torch, sys, collections
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from fiddler import Engine
path = "/root/.cache/fiddler/models/small_mixtral-d3e36049b2"
eng = Engine.from_pretrained(path, cpu_threads=2, max_seq_len=128, max_batch=16)
m = eng.model
acc = collections.defaultdict(float)
def wrap(obj, name, key):
    f = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[key] += time.perf_counter() - t; return r
    setattr(obj, name, w)
wrap(m, "forward", "forward")
wrap(m.cache, "reorder", "reorder")
wrap(eng.executor, "forward", "experts")
wrap(m, "lm_head", "lm_head") if hasattr(m, "lm_head") else None
ids = torch.randint(0, 32000, (32,), generator=torch.Generator().manual_seed(1))
B = int(sys.argv[1])
for r in range(3):
    acc.clear()
    t0 = time.perf_counter(); out = eng.generate(ids, max_new_tokens=64, beam_width=B); dt = time.perf_counter() - t0
    lat = out.stats["decode_latencies_s"]
    print(f"beam {B}: total {dt:.3f} s, decode sum {sum(lat):.3f}, ttft {out.stats['ttft_s']:.3f} | " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()), flush=True)
