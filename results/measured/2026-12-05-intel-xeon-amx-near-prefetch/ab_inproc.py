"""In-process A/B of two builds of the kernel library on the same packed experts: this tree's (head,
through fiddler.kernels) and another build's .so (base, through ctypes), calls alternated back to back,
each expert streamed from DRAM (copies cycled). Usage: ab_inproc.py BASE_SO [min_tokens]"""
import ctypes as c, sys, time, statistics, torch, fiddler.kernels as fk
H, F = 4096, 14336
base = c.CDLL(sys.argv[1])
base.fk_expert_ffn.argtypes = [c.c_void_p, c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_int]
base.fk_configure.argtypes = [c.c_int, c.c_int, c.c_int]
head = fk._lib.lib
mins = (sys.argv[2] if len(sys.argv) > 2 else "8").split(":")
min_base, min_head = int(mins[0]), int(mins[-1])
min_tok = f"base {min_base} head {min_head}"
isa = head.fk_isa()
assert head.fk_configure(isa, 1, min_head) == 0 and base.fk_configure(isa, 1, min_base) == 0, "configure"
g = torch.Generator().manual_seed(0)
P = []
for _ in range(5):
    w1 = (torch.randn(F, H, generator=g) * H**-0.5).to(torch.bfloat16); w3 = (torch.randn(F, H, generator=g) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(H, F, generator=g) * F**-0.5).to(torch.bfloat16)
    P.append(fk.PackedExpert(w1, w3, w2))
nbytes = P[0].nbytes
i = 0
def call_base(e, x, out):
    rc = base.fk_expert_ffn(e._w13.data_ptr(), e._w2.data_ptr(), H, F, x.data_ptr(), x.shape[0], out.data_ptr(), 0)
    assert rc == 0
def call_head(e, x, out):
    e.forward(x, out=out)
for T in [int(t) for t in (sys.argv[3].split(",") if len(sys.argv) > 3 else "1,4,8,16".split(","))]:
    x = torch.randn(T, H).to(torch.bfloat16); ob = torch.empty(T, H, dtype=torch.bfloat16); oh = torch.empty_like(ob)
    call_base(P[0], x, ob); call_head(P[1 % 5], x, oh)
    call_base(P[2], x, ob); call_head(P[2], x, oh)
    if min_base == min_head: assert torch.equal(ob, oh), "the builds disagree"
    tb, th = [], []
    for r in range(16):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            e = P[i % 5]; i += 1
            t = time.perf_counter()
            (call_base if side == 0 else call_head)(e, x, ob if side == 0 else oh)
            (tb if side == 0 else th).append(time.perf_counter() - t)
    gb = lambda ts: nbytes / min(ts) / 1e9
    med = lambda ts: nbytes / statistics.median(ts) / 1e9
    print(f"T={T:3d} amx_min={min_tok}: base best {gb(tb):5.1f} GB/s median {med(tb):5.1f} | head best {gb(th):5.1f} median {med(th):5.1f} | head/base (median time) {statistics.median(tb)/statistics.median(th):.3f}")
