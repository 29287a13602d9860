"""bf16 expert kernel, Mixtral-8x7B expert streamed from DRAM: time per token count, vs memory and compute."""
import sys, time, torch
import fiddler.kernels as fk
H, F = 4096, 14336
toks = [int(t) for t in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 16, 32, 64, 128]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
g = torch.Generator().manual_seed(0)
e0 = fk.PackedExpert(*(torch.randn(*s, generator=g).to(torch.bfloat16) * 0.02 for s in ((F, H), (F, H), (H, F))))
w13, w2 = e0.packed()
ex = [e0] + [fk.PackedExpert.from_packed(H, F, w13, w2) for _ in range(3)]
# in-cache compute: a small expert (hidden 4096, ffn 256: 6 MB... stays in L2+L3?) 
small = fk.PackedExpert(*(torch.randn(*s, generator=g).to(torch.bfloat16) * 0.02 for s in ((256, H), (256, H), (H, 256))))
print(fk.features()["amx_min_tokens"], fk.blocking_choice())
for T in toks:
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    best = 1e9; bs = 1e9
    for r in range(rounds):
        for e in ex:
            t0 = time.perf_counter(); e.forward(x, out=out); best = min(best, time.perf_counter() - t0)
        for _ in range(5):
            t0 = time.perf_counter(); small.forward(x, out=out); bs = min(bs, time.perf_counter() - t0)
    fl = 6 * H * F * T
    cfl = 6 * H * 256 * T
    print(f"T={T:4d} stream {best*1e3:7.2f} ms  {e0.nbytes/best/1e9:5.1f} GB/s  {fl/best/1e12:5.2f} TFLOPS | small in-cache {cfl/bs/1e12:5.2f} TFLOPS -> compute-only est {fl/(cfl/bs)*1e3:6.2f} ms", flush=True)
