"""llama.cpp's placement and execution on the simulator's clock (mode=simulate).

Placement is systems/llama_cpp/layers.py, the same function execute mode uses: `-ngl` as many whole
layers as fit the GPU budget (the last ones; the output layer once every decoder layer is on), or with
`n_cpu_moe=-1` every layer on the GPU except the expert FFNs of the first N layers (`--n-cpu-moe`).
Execution, one thing at a time (llama.cpp runs its graph in order, no CPU/GPU overlap):

- a layer on the CPU runs attention (with its KV cache), norms, router and its routed experts on the CPU
  with llama.cpp's own CPU kernels (their efficiency, measured on this project's hosts, is below);
- a layer on the GPU runs them on the GPU; an activation crossing devices is copied;
- large batches (prompt chunks of >= OFFLOAD_MIN_BATCH tokens) do what llama.cpp's scheduler does when a
  GPU backend is present: the CPU-resident weights of the op are copied to the GPU and the matmul runs
  there (ggml's "offload op" rule), so a long prompt streams host weights over PCIe once per chunk of
  n_batch tokens;
- weight bytes per type from layers.BITS_PER_WEIGHT (bf16 by default).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from fiddler.sim import SimContext, SimPolicy, Step

from .layers import BITS_PER_WEIGHT, cpu_moe_layers, gpu_layers

#: ggml-backend's batch size from which an op with host weights is offloaded to the GPU (GGML_SCHED
#: op offload: the CUDA backend's offload_op accepts batches of >= 32 rows)
OFFLOAD_MIN_BATCH = 32
#: CUDA kernels per layer of llama.cpp's graph (norms, q/k/v/o, rope, attention, router, top-k, expert
#: matmuls, adds); decode runs as a CUDA graph, so this is the launch floor per layer
KERNELS_PER_LAYER = 20

_SWEEP = "results/measured/2026-12-01-intel-xeon-small_mixtral-3systems/records-{1,2,3}.jsonl"
_EPYC = "results/measured/2026-11-29-small_mixtral-2core-epyc/records.jsonl"

#: llama.cpp's CPU kernels (bf16 GGUF) per CPU class of fiddler.sim.efficiency: weight-streaming fraction
#: of the read limit at decode, and GEMM GFLOP/s per core at prompt sizes.
CPU_FACTORS: dict[str, dict[str, Any]] = {
    "intel_sapphire_rapids": {
        "bw_fraction": 0.59, "gflops_per_core": 54.0,
        "source": f"{_SWEEP}: llama.cpp decode at 0.58 / 0.62 / 0.57 of its decode bound (best of 3 reps, 3 sweeps; "
                  "mean 0.59); TTFT 1.73 s for 128 prompt tokens of small_mixtral = 0.22 s of weight reads at that "
                  "rate + 163 GFLOP at about 108 GFLOP/s on 2 cores (no AMX in llama.cpp's bf16 path)"},
    "amd_zen": {
        "bw_fraction": 0.89, "gflops_per_core": 131.0,
        "source": f"{_EPYC}: decode 28.1 tok/s x 1.409 GB per token over a 44.6 GB/s limit = 0.89; TTFT 0.73 s "
                  "for 128 tokens = 0.11 s of reads + 163 GFLOP at about 263 GFLOP/s on 2 cores"},
    "intel_skylake_avx512": {
        "bw_fraction": 0.59, "gflops_per_core": 40.0,
        "source": "assumption: no such CPU measured; the Intel bandwidth fraction, fiddler's class GEMM rate"},
    "avx2_desktop": {
        "bw_fraction": 0.59, "gflops_per_core": 54.0,
        "source": "assumption: no such CPU measured; the Sapphire Rapids llama.cpp factors (its bf16 path uses "
                  "no AMX there either)"},
}


class LlamaCppSimPolicy(SimPolicy):
    name = "llama_cpp"

    def __init__(self, n_gpu_layers: int | None, n_cpu_moe: int, quant: str, n_batch: int, n_ctx: int | None,
                 kv_cache_type: str):
        self.n_gpu_layers, self.n_cpu_moe = n_gpu_layers, n_cpu_moe
        self.quant, self.n_batch, self.n_ctx, self.kv_cache_type = quant, n_batch, n_ctx, kv_cache_type

    def setup(self, ctx: SimContext) -> None:
        c = ctx.config
        L = c.num_layers
        if self.quant not in BITS_PER_WEIGHT:
            raise ValueError(f"unknown GGUF type {self.quant!r}")
        self.bpw = BITS_PER_WEIGHT[self.quant] / 8
        n_ctx = max(self.n_ctx or 4096, ctx.max_seq_len * ctx.max_batch)
        self.fit = None
        if not ctx.has_gpu:
            self.gpu_attn, self.gpu_experts, self.output_gpu, self.source = 0, 0, False, "no GPU"
        elif self.n_cpu_moe == -1 or self.n_gpu_layers is None:
            fn = cpu_moe_layers if self.n_cpu_moe == -1 else gpu_layers
            self.fit = fn(c, ctx.gpu_budget_bytes, self.quant, n_ctx, self.kv_cache_type)
            self.gpu_attn, self.gpu_experts = self.fit.gpu_layers, self.fit.gpu_expert_layers
            self.output_gpu = self.fit.output_on_gpu
            self.source = f"derived from the GPU budget ({fn.__name__})"
        else:
            ngl = L + 1 if self.n_gpu_layers == -1 else self.n_gpu_layers
            self.gpu_attn = min(L, ngl)
            self.gpu_experts = max(0, self.gpu_attn - max(0, self.n_cpu_moe - (L - self.gpu_attn)))
            self.output_gpu = ngl > L
            self.source = "system.n_gpu_layers"
        factors = CPU_FACTORS.get(ctx.hw.eff.cpu.name)
        if factors is None:
            raise ValueError(f"no llama.cpp CPU factors for CPU class {ctx.hw.eff.cpu.name!r}")
        self.cpu_factors = factors
        self.expert_bytes = c.expert_params() * self.bpw
        self.layer_bytes = c.layer_non_expert_params() * self.bpw
        self.reset()

    def reset(self) -> None:
        self.st = {"routed_tokens": 0, "token_hits": 0, "tokens": {"gpu": 0, "cpu": 0, "copied_for_batch": 0},
                   "bytes_h2d_weights": 0, "bytes_activations": 0}

    # layers are numbered from the input: -ngl N puts the last N on the GPU; --n-cpu-moe N keeps the experts of
    # the first N in host memory
    def _attn_on_gpu(self, layer: int, L: int) -> bool:
        return layer >= L - self.gpu_attn

    def _experts_on_gpu(self, layer: int, L: int) -> bool:
        return layer >= L - self.gpu_experts

    def _cpu(self, ctx, nbytes, flops):
        f = self.cpu_factors
        return ctx.hw.cpu(nbytes, flops, bw_fraction=f["bw_fraction"], gflops_per_core=f["gflops_per_core"])

    def _matmul(self, clock, ctx, on_gpu: bool, nbytes: float, flops: float, rows: int, ready: float) -> float:
        """One op with weights of nbytes: on the GPU, on the CPU, or (host weights, a big batch, a GPU
        present) copied to the GPU and run there."""
        if on_gpu:
            return clock.gpu.run(ready, ctx.hw.gpu(nbytes, flops, KERNELS_PER_LAYER // 2))
        if ctx.has_gpu and rows >= OFFLOAD_MIN_BATCH:
            copied = clock.h2d.run(ready, ctx.hw.h2d(nbytes))
            self.st["bytes_h2d_weights"] += int(nbytes)
            return clock.gpu.run(copied, ctx.hw.gpu(nbytes, flops, 1))
        return clock.cpu.run(ready, self._cpu(ctx, nbytes, flops))

    def _cross(self, clock, ctx, to_gpu: bool, rows: int, ready: float) -> float:
        nbytes = rows * ctx.costs.activation_row_bytes
        self.st["bytes_activations"] += nbytes
        return (clock.h2d if to_gpu else clock.d2h).run(ready, ctx.hw.h2d(nbytes) if to_gpu else ctx.hw.d2h(nbytes))

    def layer(self, clock, ctx: SimContext, step: Step, layer: int, routing, ready: float) -> float:
        c = ctx.config
        L = c.num_layers
        costs = ctx.costs
        ids = routing.ids[layer]
        counts = np.bincount(ids.ravel(), minlength=c.expert_slots)
        attn_gpu, exp_gpu = self._attn_on_gpu(layer, L), self._experts_on_gpu(layer, L)
        prev_gpu = self._attn_on_gpu(layer - 1, L) if layer else False  # the embedding is in host memory
        kv_extra = costs.attention(step)[0] - costs.layer_bytes  # KV cache bytes of this step
        t = ready
        chunks = math.ceil(step.tokens / self.n_batch) if step.prefill else 1
        for k in range(chunks):
            rows = min(self.n_batch, step.tokens - k * self.n_batch) if step.prefill else step.tokens
            share = rows / step.tokens
            if attn_gpu != prev_gpu and ctx.has_gpu:
                t = self._cross(clock, ctx, attn_gpu, rows, t)
            _, flops = costs.attention(step)
            t = self._matmul(clock, ctx, attn_gpu, self.layer_bytes + kv_extra * share, flops * share, rows, t)
            if exp_gpu != attn_gpu:
                t = self._cross(clock, ctx, exp_gpu, rows, t)
            chunk_counts = counts if chunks == 1 else np.bincount(
                ids[k * self.n_batch:k * self.n_batch + rows].ravel(), minlength=c.expert_slots)
            for e in np.nonzero(chunk_counts)[0]:
                n = int(chunk_counts[e])
                t = self._matmul(clock, ctx, exp_gpu, self.expert_bytes, costs.expert_flops_per_token * n, rows, t)
            prev_gpu = exp_gpu
        n_routed = int(ids.size)
        self.st["routed_tokens"] += n_routed
        if exp_gpu:
            self.st["token_hits"] += n_routed
            self.st["tokens"]["gpu"] += n_routed
        elif ctx.has_gpu and step.tokens >= OFFLOAD_MIN_BATCH:
            self.st["tokens"]["copied_for_batch"] += n_routed
        else:
            self.st["tokens"]["cpu"] += n_routed
        self._last_on_gpu = exp_gpu
        return t

    def dense_layer(self, clock, ctx: SimContext, step: Step, layer: int, ready: float) -> float:
        """A dense layer (DeepSeek's first_k_dense_replace): attention and its MLP where -ngl put the layer
        (prompt chunks not split: the weights of a host layer cross PCIe once per big batch)."""
        L = ctx.config.num_layers
        attn_gpu = self._attn_on_gpu(layer, L)
        prev_gpu = self._attn_on_gpu(layer - 1, L) if layer else False
        t = ready
        if attn_gpu != prev_gpu and ctx.has_gpu:
            t = self._cross(clock, ctx, attn_gpu, step.tokens, t)
        nbytes, flops = ctx.costs.attention(step)
        mlp_bytes, mlp_flops = ctx.costs.dense_mlp(step)
        kv_extra = nbytes - ctx.costs.layer_bytes
        weights = self.layer_bytes + mlp_bytes / ctx.dtype.itemsize * self.bpw
        t = self._matmul(clock, ctx, attn_gpu, weights + kv_extra, flops + mlp_flops, step.tokens, t)
        self._last_on_gpu = attn_gpu
        return t

    def head(self, clock, ctx: SimContext, step: Step, ready: float) -> float:
        nbytes, flops = ctx.costs.head(step)
        nbytes = nbytes / ctx.dtype.itemsize * self.bpw
        t = ready
        if self.output_gpu != getattr(self, "_last_on_gpu", False) and ctx.has_gpu:
            t = self._cross(clock, ctx, self.output_gpu, step.rows, t)
        return self._matmul(clock, ctx, self.output_gpu, nbytes, flops, step.rows, t)

    def embed(self, clock, ctx: SimContext, step: Step, ready: float) -> float:
        return clock.cpu.run(ready, self._cpu(ctx, step.tokens * ctx.config.hidden_size * self.bpw, 0.0))

    def stats(self) -> dict[str, Any]:
        st = dict(self.st)
        st["gpu_hit_rate"] = st["token_hits"] / st["routed_tokens"] if st["routed_tokens"] else None
        return st

    def info(self) -> dict[str, Any]:
        return {"policy": self.name, "quant": self.quant, "gpu_layers": self.gpu_attn,
                "gpu_expert_layers": self.gpu_experts, "output_on_gpu": self.output_gpu,
                "placement_source": self.source, "fit": self.fit.as_dict() if self.fit else None,
                "n_batch": self.n_batch, "offload_min_batch": OFFLOAD_MIN_BATCH,
                "cpu_factors": self.cpu_factors}
