"""The expert FFN in torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..weights import ExpertWeights


def torch_expert(w: ExpertWeights, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU expert, op for op as transformers' Mixtral experts: (silu(x W1^T) * (x W3^T)) W2^T. With w1 and
    w3 stacked (ExpertWeights.w13: the GPU side's copies) both products are one GEMM: each output is the
    same dot product, one launch fewer. `out`: the result is written there (matmul's out: the same bits as
    F.linear without bias, which is that matmul)."""
    if w.w13 is not None:
        h = F.linear(x, w.w13)
        F_ = w.w1.shape[0]
        h = F.silu(h[:, :F_]) * h[:, F_:]
    else:
        h = F.silu(F.linear(x, w.w1)) * F.linear(x, w.w3)
    return F.linear(h, w.w2) if out is None else torch.matmul(h, w.w2.t(), out=out)


def torch_experts_row(ws: list[ExpertWeights], x: torch.Tensor, outs: list[torch.Tensor], scratch: torch.Tensor) -> None:
    """One row x [1, H] through several experts (decode on the GPU side), expert n's output written into
    outs[n] [1, H]: the same ops as torch_expert per expert (each product its own GEMM, written in place),
    but the silu and the product of the halves run once over all the experts' rows (`scratch` [len(ws), 2F]),
    two launches instead of two per expert. Elementwise, so the same bits. Needs w13 (stacked) on every
    expert, all of one intermediate size."""
    F_ = ws[0].w1.shape[0]
    for n, w in enumerate(ws):
        torch.matmul(x, w.w13.t(), out=scratch[n : n + 1])
    h = F.silu(scratch[:, :F_]) * scratch[:, F_:]
    for n, w in enumerate(ws):
        torch.matmul(h[n : n + 1], w.w2.t(), out=outs[n])
