import time, torch
torch.set_num_threads(1)
L, B, H, S, D = 8, 16, 4, 128, 128
k = torch.randn(L, B, H, S, D).to(torch.bfloat16); v = k.clone()
g = torch.Generator().manual_seed(0)
def cur(t, beam_idx, length):
    moved = torch.nonzero(beam_idx != torch.arange(beam_idx.shape[0])).flatten()
    src = beam_idx[moved]
    t[:, moved, :, :length] = t[:, src, :, :length]
def alt(t, beam_idx, length):
    moved = torch.nonzero(beam_idx != torch.arange(beam_idx.shape[0])).flatten()
    src = beam_idx[moved]
    tmp = t[:, :, :, :length].index_select(1, src)
    t[:, :, :, :length].index_copy_(1, moved, tmp)
for length in (40, 96):
    idx = torch.randint(0, B, (B,), generator=g)
    a, b = k.clone(), k.clone()
    cur(a, idx, length); alt(b, idx, length); assert torch.equal(a, b)
    for f in (cur, alt):
        ts = []
        for r in range(20):
            t0 = time.perf_counter(); f(k, idx, length); f(v, idx, length); ts.append(time.perf_counter() - t0)
        print(f.__name__, length, f"{min(ts)*1e3:.2f} ms")
