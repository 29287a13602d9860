"""The streaming bound of a long prefill: how fast any CPU-GPU schedule could compute a prompt.

A prompt long enough makes every expert busy, and copying an expert to the GPU cheaper than running it on
the CPU. The fastest schedule then streams every non-resident expert over PCIe once, overlapped with the
GPU's compute, so the prefill takes at least

    max(non-resident expert bytes / PCIe rate, prefill FLOPs (attention's included) / GPU rate)

from the same spec the clock charges (rates times their efficiency fractions; latencies and launch floors
left out, which only makes the bound lower). A simulated or measured TTFT over this bound says how much of
the hardware a schedule leaves unused; kTransformers' layerwise prefill and FreeToken's double-buffered
streaming are schedules that aim at it.
"""
from __future__ import annotations

from typing import Any

from .simulator import SimContext, Step


def prefill_flops(ctx: SimContext, input_len: int, rows: int = 1) -> float:
    """FLOPs of a prefill of `input_len` tokens on `rows` sequences: every layer's attention block (causal:
    the quadratic part too), dense MLPs, every routed expert slot of every token, and the lm_head of the
    last positions, as fiddler.sim.ModelCosts counts them."""
    c, costs = ctx.config, ctx.costs
    step = Step(0, input_len * rows, rows, input_len, True)
    flops = 0.0
    for layer in range(c.num_layers):
        flops += costs.attention(step)[1]
        if c.is_dense_layer(layer):
            flops += costs.dense_mlp(step)[1]
        else:
            flops += step.tokens * c.active_slots * costs.expert_flops_per_token
    return flops + costs.head(step)[1]


def prefill_streaming_bound(ctx: SimContext, resident_experts: int, input_len: int, rows: int = 1) -> dict[str, Any]:
    """The bound above for ctx's model and machine with `resident_experts` experts on the GPU: its two terms
    (seconds) and which one binds."""
    if not ctx.has_gpu:
        raise ValueError("the streaming bound needs a GPU side (ctx has no GPU budget or the spec no GPU)")
    c, s = ctx.config, ctx.hw.spec
    streamed = max(0, c.num_moe_layers * c.expert_slots - resident_experts)
    streamed_bytes = float(streamed) * ctx.costs.expert_bytes
    pcie_s = streamed_bytes / (s.pcie_h2d_gbps * 1e9 * s.pcie_eff)
    flops = prefill_flops(ctx, input_len, rows)
    gpu_s = flops / (s.gpu_bf16_tflops * 1e12 * s.gpu_flops_eff)
    return {"bound_s": max(pcie_s, gpu_s), "pcie_s": pcie_s, "gpu_s": gpu_s,
            "binds": "pcie" if pcie_s >= gpu_s else "gpu", "streamed_experts": streamed,
            "streamed_bytes": streamed_bytes, "flops": flops, "tokens": input_len * rows}
