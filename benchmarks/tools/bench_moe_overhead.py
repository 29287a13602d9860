#!/usr/bin/env python
"""Per-layer overhead of the executor (routing bookkeeping, planner, dispatch) against the experts' own
time, for many small experts: Qwen3-30B-A3B's expert shape (hidden 2048, 128 experts of width 768, top-8).

One MoE layer of random bf16 experts; every call draws fresh random top-8 ids per row (so experts come
from DRAM, as in decode). Per row count T it times, interleaved, best and median of --repeats:
  layer   FiddlerExecutor.forward (what the model calls), no GPU (every expert on the CPU kernel)
  kernel  the same experts with the kernel alone: for T == 1 one fiddler.kernels.moe_ffn call (what the
          executor issues), for T > 1 one PackedExpert.forward per routed expert (its CPU queue)
  plan    the general path's bookkeeping alone: grouping the rows by expert (ExpertGroups) and the
          "makespan" planner over all 128 experts (1/4 resident, latency model from a hardware spec),
          what a layer with a GPU side adds before any expert runs
overhead = layer - kernel, as a fraction of kernel; plan as a fraction of kernel.

  python benchmarks/tools/bench_moe_overhead.py --tokens 1 4 --repeats 30
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch

from fiddler import kernels
from fiddler.config import MoEConfig
from fiddler.executors import GpuSide, build_executor
from fiddler.executors.routing import ExpertGroups
from fiddler.hardware import cpu_name
from fiddler.latency import HardwareSpec, LatencyModel
from fiddler.planner import get_planner
from fiddler.weights import ExpertWeights


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    H, F, E, K = args.hidden, args.ffn, args.experts, args.top_k
    cfg = MoEConfig(hidden_size=H, intermediate_size=F, num_layers=1, num_experts=E, top_k=K, num_heads=16,
                    num_kv_heads=4, head_dim=128, vocab_size=1000, model_type="qwen3_moe")
    g = torch.Generator().manual_seed(0)

    def experts():
        return [[ExpertWeights(*(torch.rand(*s, generator=g).sub_(0.5).mul_(0.05).to(torch.bfloat16)
                                 for s in ((F, H), (F, H), (H, F)))) for _ in range(E)]]

    cpu_ex = build_executor(cfg, experts(), gpu=GpuSide.none(), max_seq_len=64, max_batch=max(args.tokens),
                            take_ownership=True)
    # the planner as a GPU side runs it: 1/4 of the experts resident, an RTX 4090-class latency model
    lm = LatencyModel.from_hardware_spec(HardwareSpec(1008, 165, 25, 83.2, 16, "avx512_bf16", 25), cfg,
                                         torch.bfloat16)
    resident = [e < E // 4 for e in range(E)]
    plan_makespan = get_planner("makespan")
    packed = cpu_ex.packed[0]
    eb = cfg.expert_bytes(torch.bfloat16)
    print(f"H={H} F={F} E={E} top-{K}; expert {eb / 2**20:.2f} MiB bf16; kernel {kernels.isa()}, "
          f"{kernels.get_num_threads()} threads; CPU: {cpu_name()}")
    for T in args.tokens:
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        times: dict[str, list[float]] = {"layer": [], "kernel": [], "plan": []}
        for _ in range(args.repeats):
            for name in times:
                idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
                w = torch.softmax(torch.randn(T, K, generator=g), -1).to(torch.bfloat16)
                if name == "kernel":
                    t0 = time.perf_counter()
                    if T == 1:
                        kernels.moe_ffn([packed[e] for e in idx[0].tolist()], w[0].contiguous(), x)
                    else:
                        groups = ExpertGroups(idx, E, 0)
                        for e in groups.active():
                            tok, _ = groups.pairs(e)
                            packed[e].forward(x[tok].contiguous())
                    times[name].append(time.perf_counter() - t0)
                elif name == "plan":
                    t0 = time.perf_counter()
                    groups = ExpertGroups(idx, E, 0)
                    plan_makespan(groups.counts, resident, lm)
                    times[name].append(time.perf_counter() - t0)
                else:
                    t0 = time.perf_counter()
                    cpu_ex.forward(0, x, idx, w)
                    times[name].append(time.perf_counter() - t0)
        best = {k: min(v) for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        distinct = "8" if T == 1 else f"~{E * (1 - (1 - K / E) ** T):.0f}"
        print(f"T={T} ({distinct} distinct experts, {'one moe_ffn call' if T == 1 else 'one call per expert'}): "
              + ", ".join(f"{k} best {best[k] * 1e3:.3f} ms median {med[k] * 1e3:.3f} ms" for k in times))
        print(f"   layer: overhead over the kernel {(best['layer'] - best['kernel']) * 1e6:.0f} us best "
              f"({(best['layer'] - best['kernel']) / best['kernel']:.1%}), "
              f"{(med['layer'] - med['kernel']) * 1e6:.0f} us median ({(med['layer'] - med['kernel']) / med['kernel']:.1%})")
        print(f"   plan: {best['plan'] * 1e6:.0f} us best ({best['plan'] / best['kernel']:.1%} of the kernel), "
              f"{med['plan'] * 1e6:.0f} us median ({med['plan'] / med['kernel']:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
