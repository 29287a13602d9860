"""Self time per part of a beam decode step (after the prefill), engine only: python profile_beam_step.py WIDTH [NEW_TOKENS]"""
import os, sys, time, torch
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_root = __import__("pathlib").Path(__file__).resolve().parents[3]; sys.path.insert(0, str(_root / "scripts")); sys.path.insert(0, str(_root))
from profile_prefill import Sections, Patches
from runners.models import synthetic_model
from fiddler import Engine
W = int(sys.argv[1]); N = int(sys.argv[2]) if len(sys.argv) > 2 else 16
path = synthetic_model("small_mixtral")
e = Engine.from_pretrained(path, cpu_threads=2, max_seq_len=128, max_batch=W)
m, ex = e.model, e.executor
sec = Sections(); p = Patches()
class Wrap:
    def __init__(s, o): s.o = o
    def __getattr__(s, a): return getattr(s.o, a)
    def __call__(s, *a, **k):
        with sec.section("attention"): return s.o(*a, **k)
m._decode_ops = Wrap(m._decode_ops)
p.wrap(m, "_decode_norm", sec, "norms")
p.wrap(m.cache, "reorder", sec, "kv reorder")
p.wrap(m, "lm_head", sec, "lm_head")
for l in m.layers:
    p.wrap(l, "qkv_proj", sec, "projections"); p.wrap(l, "o_proj", sec, "projections"); p.wrap(l, "router", sec, "router")
import fiddler.model as fm
p.wrap(fm, "route", sec, "router")
p.wrap(ex, "forward", sec, "experts (around)")
pk = next(x for r in ex.packed for x in r if x is not None)
calls = [0]
f0 = type(pk).forward
def kf(self, *a, **k):
    calls[0] += 1
    with sec.section("experts (kernel)"): return f0(self, *a, **k)
type(pk).forward = kf
ids = torch.randint(0, 32000, (32,), generator=torch.Generator().manual_seed(0))
e.generate(ids, max_new_tokens=4, beam_width=W)
best = None
for r in range(2):
    sec.reset(); calls[0] = 0
    out = e.generate(ids, max_new_tokens=N, beam_width=W, on_first_token=lambda: (sec.reset(), calls.__setitem__(0, 0)))
    st = out.stats
    dec = st["decode_s"]
    if best is None or dec < best[0]:
        best = (dec, dict(sec.self_s), st["decode_experts_per_layer"], calls[0], st["ttft_s"])
dec, parts, epl, nk, ttft = best
steps = N - 1
print(f"W={W} decode {dec/steps*1e3:.1f} ms/step, experts/layer {epl:.2f}, kernel calls/step/layer {nk/steps/8:.2f}  ttft {ttft*1e3:.0f}")
tot = 0
for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
    print(f"  {k:18s} {v/steps*1e3:8.2f} ms/step")
