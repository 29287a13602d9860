"""The released Fiddler, as the paper ran it, on the simulator's clock (`system=fiddler_original`, simulate only).

The code the paper ran is efeslab/fiddler main at 227715b (`src/fiddler/mixtral.py`): main is the branch the
paper's abstract links (https://github.com/efeslab/fiddler) and it was reverted to this pure-PyTorch version
on 2024-04-18 ("reverse main branch to pure python version", efeslab/fiddler@2b6551a); the `cppExpert` branch
holds the C++ AVX512-BF16 expert that main does not call, and `batched_baseline` holds the baselines' runs.
Every choice below is a `Cited` parameter in PARAMS (systems/citations.py); `system=fiddler_paper` is the
paper's rule in this project's engine, `system=fiddler` the project's planner.

What one MoE layer costs (mixtral_forward, #L476-648), one thing at a time on one timeline:
- attention, norms and router on the GPU in transformers' eager modules (#L486-505), and the plan's
  `torch.where` per expert and Python brute force (#L556-590): the GPU class's measured cost of exactly that
  loop under transformers 4.36.2 (`release_layer_overhead_s`), or the roofline if longer;
- the plan (#L556-590): expert e with n tokens costs n x latency_cpu on the CPU, latency_gpu on the GPU
  (0 when resident); the brute force over 2^8 assignments minimises the *sum* of costs (its comment says the
  max), so each expert independently takes the cheaper side, a tie going to the GPU (config 0 is tried first
  and only a strictly lower sum replaces it): a non-resident expert runs on the CPU when 7 n < 70, else it is
  copied in;
- the GPU experts first, in expert order (#L602-621): a resident one computes; a copied one is
  `expert_placeholder.load_state_dict(...)` from pageable host tensors, a synchronous copy at the pageable rate,
  then computes;
- then the CPU experts one by one (#L623-637): the rows copied to the host (`.to("cpu")`, which waits for the
  GPU), the expert in PyTorch bf16 on `torch.set_num_threads(16)` threads (#L374, #L650-654), the result back;
- placement (#L351-361): the experts that fit 95% of the card's memory after what is allocated then (the
  non-expert weights and the one-expert `expert_placeholder`, #L24-26), by popularity (#L72-338's order comes from a profile; the project's reference profile of the same model
  stands in for it).
Beam search (#L363-467): the prompt replicated beam_width times and prefilled as one batch, the top beam_width
tokens at the first step, then each beam greedy: decode forwards of beam_width rows. Tokens per second: one
sequence's output tokens over prefill + decode (benchmarks/latency.py#L67-80), as the harness counts.

PyTorch's CPU expert (bf16 F.linear, no Fiddler kernel) costs bytes / streaming rate + FLOPs / (cores used x
GFLOP/s per core), the factors measured here (TORCH_FACTORS). On the measuring host (2 cores) one thread of the
read-limit probe reads half of what two do (19.0 vs 37.9 GB/s), and torch's 1-token expert reads 10.9 GB/s per
core with both: a per-core streaming rate. So rate = min(read limit, cores used x GB/s per core). Its 16 threads
on the described machine: cores used = min(16, the environment's cores) (threads beyond the cores add no load
units; env1's 12-core socket runs the 16 threads on 12 cores; env2 runs them on 16 of its 56 cores).
The measurement must be taken on a quiet host: with another process on one of the two cores, a 2-thread
OpenMP call runs at its straggler's pace (results/measured/2026-12-02-intel-xeon-torch-bf16-expert/
torch_expert-run3-contended.json: 2 threads 5.9 GB/s, slower than 1 thread's 7.9, and a read limit of 20.6 =
one core's); the 2026-12-03 reading this model first used (6.6 GB/s at 1 token, limit 19.3) was such a one.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from systems.citations import Cited
from fiddler.sim import SimContext, SimPolicy, Step
from fiddler.sim.fiddler_policy import ATTENTION_LAUNCHES

_SRC = "efeslab/fiddler@227715b:src/fiddler/mixtral.py"
_TORCH = "results/measured/2026-12-02-intel-xeon-torch-bf16-expert/torch_expert.json"

PARAMS: dict[str, Cited] = {
    "latency_cpu": Cited(7, f"{_SRC}#L38", "cost of one token of one expert on the CPU"),
    "latency_gpu": Cited(70, f"{_SRC}#L39", "cost of one non-resident expert on the GPU (resident: 0, #L569-572)"),
    "plan_minimises_sum": Cited(True, f"{_SRC}#L576-590",
                                "the brute force over 2^8 keeps the lowest sum of costs; a tie keeps the GPU"),
    "gpu_memory_fraction": Cited(0.95, f"{_SRC}#L359-361", "experts fill 95% of the card after the non-experts"),
    "placeholder_counted": Cited(True, f"{_SRC}#L24-26 + {_SRC}#L44-48 + {_SRC}#L360",
                                 "the GPU expert_placeholder is allocated before calc_n_expert_on_gpu, so "
                                 "memory_allocated counts it: one expert fewer on the GPU"),
    "placement_by_popularity": Cited(True, f"{_SRC}#L72-76 + {_SRC}#L336-338",
                                     "the most popular experts of a profile on the GPU"),
    "non_experts_on_gpu": Cited(True, f"{_SRC}#L60-70", "embeddings, attention, norms, routers, lm_head"),
    "copy_synchronous_pageable": Cited(True, f"{_SRC}#L610-616",
                                       "a copied expert: load_state_dict into the GPU placeholder, then compute"),
    "pageable_fraction_of_pinned": Cited(0.5, "assumption: a pageable cudaMemcpy stages through a driver "
                                              "buffer (a host memcpy then the DMA); half the pinned rate, no "
                                              "measurement of the paper's hosts being available", ""),
    "gpu_then_cpu_serial": Cited(True, f"{_SRC}#L602-637", "GPU experts, then CPU experts, no overlap"),
    "cpu_expert_in_torch": Cited(True, f"{_SRC}#L650-654", "run_expert_at_cpu: the transformers expert module"),
    "cpu_threads": Cited(16, f"{_SRC}#L374", "torch.set_num_threads(16)"),
    "activations_to_cpu_sync": Cited(True, f"{_SRC}#L626-636", "rows .to('cpu'), results .to(dev)"),
    "hf_layer_modules": Cited(True, f"{_SRC}#L486-505", "transformers' eager attention and norms per layer"),
    "layer_overhead": Cited("release_layer_overhead_s",
                            "results/measured/2026-12-04-h200-hf-layer-overhead/hf436_8x7b.json",
                            "the GPU class's cost per layer of #L482-590 outside the experts (module calls and "
                            "plan), measured under transformers 4.36.2 (requirements.txt#L3) on an H200 host"),
    "beam_prompt_replicated": Cited(True, f"{_SRC}#L458-467", "tokenize: the prompt beam_width times"),
    "beam_topk_then_greedy": Cited(True, f"{_SRC}#L413-426", "top-k at the first step, then top-1 per beam"),
    "tok_s_one_sequence": Cited(True, "efeslab/fiddler@227715b:benchmarks/latency.py#L67-80",
                                "output tokens of one sequence over prefill + decode time"),
    "torch_version": Cited("2.1.2", "efeslab/fiddler@227715b:requirements.txt#L2",
                           "the torch the released code pins; TORCH_FACTORS were measured with this host's later "
                           "torch (2.13), whose oneDNN kernels may differ"),
    "torch_factors": Cited("TORCH_FACTORS", _TORCH, "PyTorch bf16 expert vs the read limit, native and AVX512_CORE"),
}

#: PyTorch's bf16 expert FFN per CPU class: GB/s of weights streamed per core at 1 token, GFLOP/s per core at
#: 128 tokens (the sum model). intel_skylake_avx512: the same
#: host with ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512 (AVX-512 without BF16 or AMX), i.e. the
#: native factors times the measured ratio of the two runs' times.
TORCH_FACTORS: dict[str, dict[str, Any]] = {
    "intel_sapphire_rapids": {"gbps_per_core": 10.9, "gflops_per_core": 860.0,
                              "source": f"{_TORCH}: native (oneDNN brgemm, AMX), 2 threads, quiet host (read limit "
                                        "37.9 GB/s, one thread 19.0): 21.8 GB/s at 1 token (16.2 ms), 860 GFLOP/s "
                                        "per core at 128 tokens"},
    "intel_skylake_avx512": {"gbps_per_core": 12.6, "gflops_per_core": 37.3,
                             "source": f"{_TORCH}: ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512, 2 "
                                       "threads, same run: 25.3 GB/s at 1 token (13.9 ms, 0.86x the native time), "
                                       "37.3 GFLOP/s per core at 128 tokens (0.618 s, 14.6x the native time)"},
}


class FiddlerOriginalSimPolicy(SimPolicy):
    name = "fiddler_original"

    def setup(self, ctx: SimContext) -> None:
        from systems.base import SystemUnavailable
        from fiddler.popularity import Popularity

        if not ctx.has_gpu:
            raise SystemUnavailable("the released Fiddler needs a CUDA GPU (torch.device('cuda:0'), mixtral.py#L15)")
        cls = ctx.hw.eff.cpu.name
        if cls not in TORCH_FACTORS:
            raise SystemUnavailable(f"no measurement of PyTorch's bf16 expert for CPU class {cls!r} (measured: "
                                    f"{sorted(TORCH_FACTORS)}; scripts/bench_torch_expert.py)")
        self.torch = TORCH_FACTORS[cls]
        c = ctx.config
        eb = ctx.costs.expert_bytes
        non_expert = (c.num_layers * ctx.costs.layer_bytes + ctx.costs.head_bytes
                      + c.vocab_size * c.hidden_size * ctx.costs.itemsize)
        # torch.cuda.memory_allocated at calc_n_expert_on_gpu (#L360): the non-experts (#L44) and the
        # expert_placeholder, a GPU copy of one expert made in __init__ before both (#L24-26)
        allocated = non_expert + (eb if PARAMS["placeholder_counted"].value else 0)
        card = ctx.gpu_budget_bytes
        n_gpu = max(0, int((card * PARAMS["gpu_memory_fraction"].value - allocated) // eb))
        pop = Popularity.for_config(c, ctx.popularity)
        shares = np.asarray(pop.shares(), dtype=np.float64)  # [layers, experts]
        order = sorted(((-shares[l, e], l, e) for l in range(c.num_moe_layers) for e in range(c.num_experts)))
        resident = [[False] * c.expert_slots for _ in range(c.num_moe_layers)]
        for _, l, e in order[:n_gpu]:
            resident[l][e] = True
        self.resident, self.n_gpu = resident, min(n_gpu, len(order))
        self.threads = min(PARAMS["cpu_threads"].value, int(ctx.hw.spec.cpu_cores))
        self.cpu_gbps = min(ctx.hw.limit_gbps, self.threads * self.torch["gbps_per_core"])
        g = ctx.hw.spec
        self.pageable_gbps = g.pcie_h2d_gbps * g.pcie_eff * PARAMS["pageable_fraction_of_pinned"].value
        self.reset()

    def reset(self) -> None:
        self.st = {"routed_tokens": 0, "token_hits": 0, "tokens": {"gpu": 0, "copy": 0, "cpu": 0},
                   "experts": {"gpu": 0, "copy": 0, "cpu": 0}, "bytes_h2d_weights": 0}

    def prefill_rows(self, beam_width: int) -> int:
        return beam_width  # the prompt replicated per beam (#L458-467)

    def _torch_expert_s(self, ctx: SimContext, tokens: int) -> float:
        flops = ctx.costs.expert_flops_per_token * tokens
        return (ctx.costs.expert_bytes / (self.cpu_gbps * 1e9)
                + flops / (self.threads * self.torch["gflops_per_core"] * 1e9) + ctx.hw.spec.cpu_call_overhead_s)

    def _pageable_s(self, ctx: SimContext, nbytes: float) -> float:
        return nbytes / (self.pageable_gbps * 1e9) + ctx.hw.spec.pcie_latency_s

    def layer(self, clock, ctx: SimContext, step: Step, layer: int, routing, ready: float) -> float:
        hw, costs = ctx.hw, ctx.costs
        m = ctx.moe_index(layer)
        ids = routing.ids[layer]
        counts = np.bincount(ids.ravel(), minlength=ctx.config.expert_slots)
        nbytes, flops = costs.attention(step)
        t = clock.gpu.run(ready, max(hw.gpu(nbytes, flops, ATTENTION_LAUNCHES), hw.eff.gpu.release_layer_overhead_s))
        lc, lg = PARAMS["latency_cpu"].value, PARAMS["latency_gpu"].value
        gpu, cpu = [], []
        for e in range(ctx.config.expert_slots):
            n = int(counts[e])
            cost_gpu = 0 if self.resident[m][e] else lg
            (cpu if n * lc < cost_gpu else gpu).append(e)  # a tie keeps the GPU (config 0 is tried first)
        eb, fpt, row = costs.expert_bytes, costs.expert_flops_per_token, costs.activation_row_bytes
        st = self.st
        for e in gpu:
            n = int(counts[e])
            if not self.resident[m][e]:
                t = clock.h2d.run(t, self._pageable_s(ctx, eb))  # synchronous: nothing else runs meanwhile
                st["bytes_h2d_weights"] += eb
                st["experts"]["copy"] += 1
                st["tokens"]["copy"] += n
            else:
                st["experts"]["gpu"] += 1 if n else 0
                st["tokens"]["gpu"] += n
                st["token_hits"] += n
            if n:
                t = clock.gpu.run(t, hw.gpu(eb, fpt * n))
        for e in cpu:
            n = int(counts[e])
            if not n:
                continue  # an empty expert on the CPU: a no-op of microseconds
            t = clock.d2h.run(t, self._pageable_s(ctx, n * row))
            t = clock.cpu.run(t, self._torch_expert_s(ctx, n))
            t = clock.h2d.run(t, self._pageable_s(ctx, n * row))
            st["experts"]["cpu"] += 1
            st["tokens"]["cpu"] += n
        st["routed_tokens"] += int(ids.size)
        return t

    def stats(self) -> dict[str, Any]:
        st = dict(self.st)
        st["gpu_hit_rate"] = st["token_hits"] / st["routed_tokens"] if st["routed_tokens"] else None
        return st

    def info(self) -> dict[str, Any]:
        return {"policy": self.name, "experts_on_gpu": self.n_gpu, "cpu_threads_modelled_on_cores": self.threads,
                "torch_cpu_gbps": self.cpu_gbps,
                "pageable_h2d_gbps": self.pageable_gbps, "torch_factors": self.torch,
                "params": {k: {"value": v.value, "source": v.source} for k, v in PARAMS.items()}}
