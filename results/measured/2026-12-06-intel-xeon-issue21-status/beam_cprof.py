import os, time, torch, sys, cProfile, pstats
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from fiddler import Engine
path = "/root/.cache/fiddler/models/small_mixtral-d3e36049b2"
eng = Engine.from_pretrained(path, cpu_threads=2, max_seq_len=128, max_batch=16)
ids = torch.randint(0, 32000, (32,), generator=torch.Generator().manual_seed(1))
B = int(sys.argv[1])
eng.generate(ids, max_new_tokens=8, beam_width=B)
pr = cProfile.Profile()
t0 = time.perf_counter()
pr.enable()
out = eng.generate(ids, max_new_tokens=64, beam_width=B)
pr.disable()
print("total", time.perf_counter() - t0, "decode", sum(out.stats["decode_latencies_s"]))
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
