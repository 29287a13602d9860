"""bf16 GEMM rate of torch's CPU matmul (oneDNN; AMX where the CPU has it) on a Mixtral-8x7B w1
(14336 x 4096) at prefill token counts: the source of fiddler.sim's CPU class `gemm_gflops_per_core`.

    python benchmarks/tools/bench_cpu_gemm.py [--threads N]
"""
import argparse
import time

import torch
import torch.nn.functional as F

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--threads", type=int, default=torch.get_num_threads())
args = ap.parse_args()
torch.set_num_threads(args.threads)
w = torch.randn(14336, 4096).to(torch.bfloat16)
for T in (16, 32, 128, 512):
    x = torch.randn(T, 4096).to(torch.bfloat16)
    F.linear(x, w)
    best = min((lambda t: (F.linear(x, w), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
    print(T, f"{2 * T * 14336 * 4096 / best / 1e9:.0f} GFLOP/s ({args.threads} threads)", f"{best * 1e3:.2f} ms")
