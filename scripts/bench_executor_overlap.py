#!/usr/bin/env python
"""Without CUDA, should the executor's CPU queue run concurrently with the (CPU-emulated) GPU side on
split cores, or serially with all cores? Times one MoE layer both ways, same plan, same process.

  python scripts/bench_executor_overlap.py --hidden 1024 --ffn 3584 --tokens 1 4 16 64
Prints one line per token count: best-of-N seconds serial vs overlap, and the decisions taken.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from fiddler.config import MoEConfig
from fiddler.executors import GpuSide, build_executor
from fiddler.latency import LatencyModel
from fiddler.weights import ExpertWeights


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3584)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    cfg = MoEConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_layers=1, num_experts=args.experts,
                    top_k=2, num_heads=8, num_kv_heads=2, head_dim=args.hidden // 8, vocab_size=1000)
    g = torch.Generator().manual_seed(0)
    experts = [[ExpertWeights(*(torch.randn(*s, generator=g).mul_(0.02).to(dtype)
                                for s in ((args.ffn, args.hidden), (args.ffn, args.hidden), (args.hidden, args.ffn))))
                for _ in range(args.experts)]]
    # half resident; non-resident experts all on the CPU, so both queues have work for any token count
    lm = LatencyModel.manual(cpu=(1e-6, 1e-5), gpu=(1e-6, 1e-5), transfer=10.0)
    kw = dict(gpu=GpuSide.emulated(1 << 40), max_seq_len=max(args.tokens), max_batch=1,
              placement="fraction:0.5", planner="paper", latency_model=lm)
    exs = {"serial": build_executor(cfg, experts, overlap=False, **kw),
           "overlap": build_executor(cfg, experts, overlap=True, **kw)}
    print(f"H={args.hidden} F={args.ffn} E={args.experts} {args.dtype}; cpu path: "
          f"{exs['serial'].info()['cpu_expert_path']}; threads serial={exs['serial'].threads.all} "
          f"overlap cpu={exs['overlap'].threads.cpu_queue}+gpu-side={exs['overlap'].threads.gpu_side}")
    for T in args.tokens:
        x = torch.randn(T, args.hidden, generator=g).to(dtype)
        # every token routes to one resident and one non-resident expert: both queues busy
        half = args.experts // 2
        idx = torch.stack([torch.arange(T) % half, half + torch.arange(T) % half], 1)
        w = torch.full((T, 2), 0.5, dtype=dtype)
        best = {}
        for _ in range(args.repeats):
            for name, ex in exs.items():
                t = time.perf_counter()
                ex.forward(0, x, idx, w)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
        dec = exs["serial"].stats.layers[0].last_decisions
        print(f"T={T:4d}  serial {best['serial'] * 1e3:8.3f} ms  overlap {best['overlap'] * 1e3:8.3f} ms  "
              f"ratio {best['overlap'] / best['serial']:.2f}  decisions {''.join(d or '-' for d in dec)}")
    exs["overlap"].close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
