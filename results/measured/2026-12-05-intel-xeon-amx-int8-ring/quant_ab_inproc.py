"""In-process A/B of two builds of the quantized expert kernel on the same packed Mixtral-8x7B experts: this
tree's (head, through fiddler.kernels.quant) and another build's .so (base, through ctypes), calls alternated
back to back, each expert streamed from DRAM (copies cycled). Both builds run their defaults (AMX-INT8 tiles
where on, from their default crossover) unless `min` sets the tiles' min tokens on both.
Usage: quant_ab_inproc.py BASE_SO fmt[,fmt] T[,T] [rounds] [min]"""
import ctypes as c, statistics, sys, time, torch
from fiddler.kernels import quant as fq
H, F = 4096, 14336
base = c.CDLL(sys.argv[1])
base.fk_qexpert_ffn.argtypes = [c.c_int, c.c_void_p, c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int, c.c_int64,
                                c.c_void_p, c.c_int]
fmts = sys.argv[2].split(",")
toks = [int(t) for t in sys.argv[3].split(",")]
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 16
if len(sys.argv) > 5:
    m = int(sys.argv[5])
    fq.set_amx("on", min_tokens=m)
    assert base.fk_set_qamx(1, m, m) == 0
for fmt in fmts:
    code = fq.FORMATS[fmt]
    g = torch.Generator().manual_seed(0)
    e0 = fq.QuantExpert.from_float(torch.randn(F, H, generator=g) * H**-0.5, torch.randn(F, H, generator=g) * H**-0.5,
                                   torch.randn(H, F, generator=g) * F**-0.5, fmt)
    w13, w2 = e0.packed()
    ex = [e0] + [fq.QuantExpert.from_packed(fmt, H, F, w13.clone(), w2.clone()) for _ in range(4)]
    i = 0
    for T in toks:
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ob, oh = torch.empty(T, H, dtype=torch.bfloat16), torch.empty(T, H, dtype=torch.bfloat16)

        def call_base(e):
            p13, p2 = e.packed()
            assert base.fk_qexpert_ffn(code, p13.data_ptr(), p2.data_ptr(), H, F, x.data_ptr(), 0, T, ob.data_ptr(), 0) == 0

        def call_head(e):
            e.forward(x, out=oh)
        call_base(ex[0]); call_head(ex[0])
        assert torch.equal(ob, oh), "the builds disagree"
        tb, th = [], []
        for r in range(rounds):
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                e = ex[i % len(ex)]; i += 1
                t = time.perf_counter()
                (call_base if side == 0 else call_head)(e)
                (tb if side == 0 else th).append(time.perf_counter() - t)
        gb = lambda ts: e0.nbytes / min(ts) / 1e9
        print(f"{fmt} T={T:3d}  base {min(tb)*1e3:6.2f} ms ({gb(tb):5.1f} GB/s)  head {min(th)*1e3:6.2f} ms ({gb(th):5.1f} GB/s)"
              f"  head/base speed: best {min(tb)/min(th):.2f}x, median {statistics.median(tb)/statistics.median(th):.2f}x",
              flush=True)
