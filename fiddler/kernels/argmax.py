"""Greedy token choice for a few CPU rows of fp32 logits (csrc/fk_argmax.cpp), one ctypes call.

`argmax_finite(logits)`: each row's torch.argmax (the first index of the largest value), or -1 for a row
that holds a NaN or an inf; the finiteness check and the choice in one pass, where torch takes a reduction,
a host read, argmax and .item() (about 30 us a token on a small model's decode step).
"""
from __future__ import annotations

import ctypes

import torch

from . import _lib

__all__ = ["is_available", "argmax_finite"]

_ok = _lib.lib is not None and hasattr(_lib.lib, "fk_argmax_f32")
if _ok:
    _argmax = _lib.lib.fk_argmax_f32


def is_available() -> bool:
    """Whether the compiled library has the call."""
    return _ok


def argmax_finite(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of `logits` (contiguous fp32 CPU [rows, n]), -1 for a row with a NaN or an inf."""
    if not _ok:
        raise RuntimeError(f"fiddler.kernels unavailable: {_lib.load_error}")
    if not (logits.dtype == torch.float32 and logits.is_cpu and logits.dim() == 2 and logits.is_contiguous()
            and logits.shape[1] > 0):
        raise ValueError(f"logits must be a contiguous non-empty 2-D CPU float32, got {logits.dtype} "
                         f"{tuple(logits.shape)} on {logits.device}")
    rows = logits.shape[0]
    idx = (ctypes.c_int64 * rows)()
    if _argmax(logits.data_ptr(), rows, logits.shape[1], idx) < 0:
        raise ValueError(f"fiddler.kernels.argmax: {_lib.last_error()}")
    return list(idx)
