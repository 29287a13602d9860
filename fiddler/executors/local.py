"""The reference executor: every expert on one device, no placement and no planning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import quant as fquant
from ..kernel_loader import load_kernels
from ..weights import ExpertWeights
from .contract import BuildContext, ExpertExecutor, StatsBase, add_residual
from .ffn import torch_expert
from .routing import ExpertGroups


@dataclass
class LocalStats(StatsBase):
    expert_calls: int = 0
    expert_tokens: int = 0


class LocalExperts(ExpertExecutor):
    """Every expert on `device` via torch, or the packed CPU kernel for bf16 on the CPU. Outputs are
    accumulated in fp32 per token, like transformers' grouped_mm path."""

    def __init__(self, config, experts: list[list[ExpertWeights]], device, dtype: torch.dtype,
                 use_kernel: bool | None = None, quant: str | None = None):
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.quant = fquant.check_quant(quant)
        self.fp32_inputs = self.quant is not None  # see ExpertExecutor.fp32_inputs
        k = load_kernels()
        if use_kernel is None:
            use_kernel = self.device.type == "cpu" and dtype == torch.bfloat16
        self.packed = None
        self.experts = None
        H, F_ = config.hidden_size, config.intermediate_size
        if self.quant is not None and use_kernel and k is not None:
            self.packed = [[fquant.pack_expert(e, self.quant, H, F_) for e in layer] for layer in experts]
        elif self.quant is not None:  # torch on the dequantized blocks (any device)
            self.experts = [[fquant.dequantize_expert(ExpertWeights(*(w.to(self.device) for w in (e.w1, e.w3, e.w2))),
                                                      self.quant, H, F_, dtype) for e in layer] for layer in experts]
        elif use_kernel and k is not None:
            self.packed = [[k.PackedExpert(e.w1, e.w3, e.w2) for e in layer] for layer in experts]
        else:
            self.experts = [
                [ExpertWeights(*(w.to(device=self.device, dtype=dtype) for w in (e.w1, e.w3, e.w2))) for e in layer]
                for layer in experts
            ]
        self.stats = LocalStats()

    def reset_stats(self) -> None:
        self.stats = LocalStats()

    def info(self) -> dict[str, Any]:
        return {"executor": f"{__name__}.LocalExperts", "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "quant": self.quant,
                "cpu_expert_path": "kernel" if self.packed is not None else "torch"}

    def _ffn(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed[layer][e].forward(x)
        return torch_expert(self.experts[layer][e], x.to(self.dtype))

    def forward(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        self.begin_forward(layer, x, topk_idx)
        T, K = topk_idx.shape
        if T == 1:  # decode: no gather/scatter
            out = None
            for k, e in enumerate(topk_idx[0].tolist()):
                y = self._ffn(layer, e, x) * topk_w[0, k].float()
                out = y if out is None else out + y
            self.stats.expert_calls += K
            self.stats.expert_tokens += K
            return add_residual(residual, out.to(self.dtype))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        groups = ExpertGroups(topk_idx, self.config.expert_slots, layer)
        for e in groups.active():
            tok, slot = groups.pairs(e)
            y = self._ffn(layer, e, x[tok].contiguous()).float() * topk_w[tok, slot].float()[:, None]
            out.index_add_(0, tok, y)
            self.stats.expert_calls += 1
            self.stats.expert_tokens += groups.counts[e]
        return add_residual(residual, out.to(self.dtype))


def local_executor(ctx: BuildContext, experts: list[list[ExpertWeights]]) -> LocalExperts:
    """Factory (fiddler.executors.ExecutorFactory): all experts on the GPU side's device, no placement."""
    return LocalExperts(ctx.config, experts, ctx.gpu.device, ctx.dtype, quant=ctx.quant)
