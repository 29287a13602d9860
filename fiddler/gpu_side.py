"""Where the engine's "GPU side" is and how much memory it may use, decided once by the caller.

The GPU side holds the non-expert weights, the KV cache, the resident experts and the copy buffers. It is
one of:

- none: no GPU. Everything lives on the CPU and every expert runs on the CPU path (kind c).
- cuda: a CUDA device with a memory budget in bytes (by default 90% of its free memory).
- emulated: the CPU device stands in for a GPU with the given budget, so placement, plans, weight copies
  and output combination run the same code as on CUDA (timings are CPU timings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NONE, CUDA, EMULATED = "none", "cuda", "emulated"

#: share of the free CUDA memory used when no budget is given
DEFAULT_CUDA_FRACTION = 0.9


@dataclass(frozen=True)
class GpuSide:
    kind: str
    budget_bytes: int | None = None  # None only for kind "none"
    device: torch.device = torch.device("cpu")

    def __post_init__(self):
        if self.kind not in (NONE, CUDA, EMULATED):
            raise ValueError(f"GpuSide kind must be {NONE!r}, {CUDA!r} or {EMULATED!r}, got {self.kind!r}")
        if (self.kind == NONE) != (self.budget_bytes is None):
            raise ValueError(f"GpuSide {self.kind!r}: a budget is required for a GPU side and meaningless without one")
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"GPU budget must be >= 0 bytes, got {self.budget_bytes}")
        if (self.device.type == "cuda") != (self.kind == CUDA):
            raise ValueError(f"GpuSide {self.kind!r} cannot live on device {self.device}")

    @classmethod
    def none(cls) -> GpuSide:
        return cls(NONE)

    @classmethod
    def emulated(cls, budget_bytes: int) -> GpuSide:
        return cls(EMULATED, int(budget_bytes))

    @classmethod
    def cuda(cls, budget_bytes: int | None = None, device: str | torch.device = "cuda") -> GpuSide:
        """A CUDA device; without a budget, DEFAULT_CUDA_FRACTION of its free memory now."""
        device = torch.device(device)
        if budget_bytes is None:
            budget_bytes = int(torch.cuda.mem_get_info(device)[0] * DEFAULT_CUDA_FRACTION)
        return cls(CUDA, int(budget_bytes), device)

    @classmethod
    def default(cls) -> GpuSide:
        """CUDA (default budget) when present, else none."""
        return cls.cuda() if torch.cuda.is_available() else cls.none()

    @property
    def has_gpu(self) -> bool:
        return self.kind != NONE

    @property
    def is_cuda(self) -> bool:
        return self.kind == CUDA

    def describe(self) -> str | None:
        """For info(): None (no GPU), "cuda" or "cpu (emulated GPU)"."""
        return {NONE: None, CUDA: "cuda", EMULATED: "cpu (emulated GPU)"}[self.kind]
