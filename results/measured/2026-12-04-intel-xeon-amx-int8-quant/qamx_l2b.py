import time, torch, sys
from fiddler.kernels import quant as fq, _L
g = torch.Generator().manual_seed(0)
T = int(sys.argv[1]) if len(sys.argv) > 1 else 16
for fmt in ("q8_0","q4_0"):
  k = 4096
  lins = {n: fq.QuantLinear.from_float(torch.randn(n, k, generator=g), fmt) for n in (128, 384)}
  x = torch.randn(T, k, generator=g).bfloat16()
  res = {}
  for rep in range(3):
    for on in (0, 1):
      _L().fk_set_qamx(1 if on else 0)
      for n, lin in lins.items():
        for _ in range(20): lin.forward(x, threads=1)
        t0 = time.perf_counter()
        for _ in range(300): lin.forward(x, threads=1)
        dt = (time.perf_counter() - t0) / 300
        res[(on, n)] = min(res.get((on, n), 9), dt)
  for on in (0, 1):
    d = res[(on, 384)] - res[(on, 128)]
    ops = 2 * 256 * k * T
    print(fmt, T, ("amx " if on else "vnni"), "marginal %.1f GOP/s  fixed %.1f us" % (ops / d / 1e9, (res[(on,128)] - d/2) * 1e6))
