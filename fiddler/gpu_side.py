"""Where the engine's "GPU side" is and how much memory it may use, decided once by the caller.

The GPU side holds the non-expert weights, the KV cache, the resident experts and the copy buffers. It is
one of:

- none: no GPU. Everything lives on the CPU and every expert runs on the CPU path (kind c).
- cuda: a CUDA device with a memory budget in bytes (by default `auto`: 90% of its free memory). The budget holds:
  placement counts the CUDA context and the cuBLAS workspace in it (`overhead_bytes`), and the engine caps
  the caching allocator at the rest (`apply_cap`: torch.cuda.set_per_process_memory_fraction).
- emulated: the CPU device stands in for a GPU with the given budget, so placement, plans, weight copies
  and output combination run the same code as on CUDA (timings are CPU timings).

What a budget as a user gives it means is one rule, fiddler.gpu_budget.choose_budget (`GpuSide.for_budget_gb`
builds the side from it): GiB, 0 = no GPU, or `auto` (also the default) = 90% of a free-memory reading.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

# the budget rule lives in a torch-free module (the harness's start checks apply it)
from . import gpu_budget as rule
from .gpu_budget import Budget, FreeMemory, Requested

NONE, CUDA, EMULATED = "none", "cuda", "emulated"


@dataclass(frozen=True)
class GpuSide:
    kind: str
    budget_bytes: int | None = None  # None only for kind "none"
    device: torch.device = torch.device("cpu")
    chosen: Budget | None = field(default=None, compare=False, repr=False)  # how for_budget_gb chose it

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
        """A CUDA device; without a budget, the auto rule on its free memory now."""
        device = torch.device(device)
        if budget_bytes is None:
            budget_bytes = rule.auto_budget_bytes(torch.cuda.mem_get_info(device)[0])
        return cls(CUDA, int(budget_bytes), device)

    @classmethod
    def default(cls) -> GpuSide:
        """The default budget (auto): CUDA with 90% of its free memory when present, else none."""
        return cls.for_budget_gb(None)

    @classmethod
    def for_budget_gb(cls, gb: Requested, free: FreeMemory | None | Callable[[], FreeMemory | None]
                      = rule.measured_free_memory) -> GpuSide:
        """A budget as a user gives it (fiddler.gpu_budget.choose_budget: GiB, 0 none, "auto" or None the
        default; `free` a reading injected for auto, else this host's), kept in `chosen`: CUDA where present,
        and without it an emulated GPU of that size (the CPU device stands in)."""
        chosen = rule.choose_budget(gb, free)
        if chosen.bytes is None:
            side = cls.none()
        elif torch.cuda.is_available():
            side = cls.cuda(chosen.bytes)
        else:
            side = cls.emulated(chosen.bytes)
        return dataclasses.replace(side, chosen=chosen)

    @property
    def has_gpu(self) -> bool:
        return self.kind != NONE

    @property
    def is_cuda(self) -> bool:
        return self.kind == CUDA

    def overhead_bytes(self) -> dict[str, int]:
        """GPU memory the process needs besides its tensors (CUDA only; {} otherwise), for placement's
        reservation: the CUDA context and the cuBLAS workspace."""
        if not self.is_cuda:
            return {}
        return {"cuda_context": cuda_context_bytes(self.device),
                "cublas_workspace": cublas_workspace_bytes(self.device)}

    def cap_bytes(self) -> int | None:
        """What the caching allocator may reserve on CUDA: the budget less the CUDA context (None off CUDA)."""
        if not self.is_cuda:
            return None
        return max(0, self.budget_bytes - cuda_context_bytes(self.device))

    def apply_cap(self) -> dict | None:
        """Cap this process's caching allocator at cap_bytes() (torch.cuda.set_per_process_memory_fraction),
        so the budget holds on the real device; returns what was set, for the record (None off CUDA)."""
        if not self.is_cuda:
            return None
        total = torch.cuda.get_device_properties(self.device).total_memory
        fraction = min(1.0, self.cap_bytes() / total)
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        return {"fraction": fraction, "cap_bytes": int(fraction * total), "device_total_bytes": int(total),
                **self.overhead_bytes()}

    def describe(self) -> str | None:
        """For info(): None (no GPU), "cuda" or "cpu (emulated GPU)"."""
        return {NONE: None, CUDA: "cuda", EMULATED: "cpu (emulated GPU)"}[self.kind]


@functools.cache
def cuda_context_bytes(device: torch.device) -> int:
    """Device memory in use that this process's caching allocator does not hold, measured once: the CUDA
    context (and, on a shared GPU, other processes' memory: then more is kept free than needed, never less)."""
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total - free - torch.cuda.memory_reserved(device)))


def cublas_workspace_bytes(device: torch.device) -> int:
    """The cuBLAS workspace PyTorch allocates (through the caching allocator) for the compute stream:
    CUBLAS_WORKSPACE_CONFIG (":KiB:count" pairs), else PyTorch's default (":4096:8" from Hopper on, else
    ":4096:2:16:8")."""
    conf = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if not conf:
        conf = ":4096:8" if torch.cuda.get_device_capability(device)[0] >= 9 else ":4096:2:16:8"
    pairs = re.findall(r":(\d+):(\d+)", conf)
    return sum(int(kib) * 1024 * int(n) for kib, n in pairs)
