"""The expert FFN in torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..weights import ExpertWeights


def torch_expert(w: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert, op for op as transformers' Mixtral experts: (silu(x W1^T) * (x W3^T)) W2^T."""
    return F.linear(F.silu(F.linear(x, w.w1)) * F.linear(x, w.w3), w.w2)
