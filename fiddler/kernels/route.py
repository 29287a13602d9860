"""The router's top-k after the softmax, for a few CPU rows (csrc/fk_route.cpp), one ctypes call.

`topk(scores, k, renorm)`: what fiddler.model.route does after its softmax (torch.topk sorted, the
renormalisation by the top-k sum, the round to bf16) as (ids int64 [rows, k], weights bf16 [rows, k]); None
where a row's top k are not unambiguous (ties, NaN) and the caller must run torch.topk. Bit-identical to
those torch ops wherever it answers (see fk_route.cpp); a renormalised top-k takes k <= 2.
"""
from __future__ import annotations

import torch

from . import _lib

__all__ = ["is_available", "topk"]

_ok = _lib.lib is not None and hasattr(_lib.lib, "fk_route_topk_f32")
if _ok:
    _topk = _lib.lib.fk_route_topk_f32


def is_available() -> bool:
    """Whether the compiled library has the routing call."""
    return _ok


def topk(scores: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids int64 [rows, k], weights bf16 [rows, k]): the top k of each row of `scores` (contiguous fp32 CPU
    [rows, experts]), renormalised to sum 1 where `renorm`; None where torch must do it (see the module
    docstring). The outputs are made here, so only `scores` is checked (a few property reads: this runs
    once a layer per decode step)."""
    if not _ok:
        raise RuntimeError(f"fiddler.kernels unavailable: {_lib.load_error}")
    if not (scores.dtype == torch.float32 and scores.is_cpu and scores.dim() == 2 and scores.is_contiguous()):
        raise ValueError(f"scores must be a contiguous 2-D CPU float32, got {scores.dtype} {tuple(scores.shape)} "
                         f"on {scores.device}")
    rows, experts = scores.shape
    ids = torch.empty(rows, k, dtype=torch.int64)
    weights = torch.empty(rows, k, dtype=torch.bfloat16)
    rc = _topk(scores.data_ptr(), rows, experts, k, int(renorm), ids.data_ptr(), weights.data_ptr())
    if rc < 0:
        raise ValueError(f"fiddler.kernels.route: {_lib.last_error()}")
    return (ids, weights) if rc == 0 else None
