import sys, os, time, torch, fiddler.kernels as fk
H, FF = 4096, 14336
g = torch.Generator().manual_seed(0)
w = (torch.randn(FF,H,generator=g).bfloat16()*0.01, torch.randn(FF,H,generator=g).bfloat16()*0.01, torch.randn(H,FF,generator=g).bfloat16()*0.01)
copies = max(1, -(-fk.stream_working_set_bytes() // (3*H*FF*2)))
ex = [fk.PackedExpert(*w)] + [fk.PackedExpert(*(a.clone() for a in w)) for _ in range(copies-1)]
buf = fk.limit_buffer()
fk.set_amx("on", min_tokens=1)
ss = sys.argv[1].split(","); toks = [int(t) for t in sys.argv[2].split(",")]
res = {}; lims = []
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 4):
  lims.append(fk.read_limit(buffer=buf, cached=False)["gbps"])
  for t in toks:
    x = torch.randn(t, H, generator=g).bfloat16(); out = torch.empty(t, H, dtype=torch.bfloat16)
    for s in ss:
      fk.set_stream(s)
      t0 = time.perf_counter()
      for e in ex: e.forward(x, out=out)
      res.setdefault((t, s), []).append(ex[0].nbytes / ((time.perf_counter() - t0) / len(ex)) / 1e9 / lims[-1])
print("limits", [round(l, 1) for l in lims])
for t in toks:
  base = res[(t, ss[0])]
  print(f"t{t}: " + "  ".join(f"{s}: best {max(res[(t,s)]):.3f} med {sorted(res[(t,s)])[len(base)//2]:.3f} (med ratio {sorted(b/a for a,b in zip(base, res[(t,s)]))[len(base)//2]:.3f})" for s in ss))
