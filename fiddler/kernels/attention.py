"""Causal prefill attention on the CPU kernel (csrc/fk_attention.cpp), one ctypes call.

`causal_attention(q, k, v, scale)`: every query at positions 0..T-1 over keys 0..T-1 with GQA, bf16,
torch's flash-attention softmax (fp32, exp as ATen's fexp_u20, p rounded to bf16), the two products by
AVX512-BF16 micro-kernels. Returns [B*T, nh*dv], the layout o_proj reads (no transpose copy). Only on
the avx512_bf16 path of the kernel; `is_available()` says whether this process has it.
"""
from __future__ import annotations

import torch

from . import _lib
from .constants import ISA_CODES

__all__ = ["causal_attention", "is_available", "supports"]

_error = None if _lib.lib is not None else f"fiddler.kernels unavailable: {_lib.load_error}"


def is_available() -> bool:
    """Whether this process's kernel runs the prefill attention (the avx512_bf16 path is active)."""
    return _lib.lib is not None and _lib.lib.fk_isa() == ISA_CODES["avx512_bf16"]


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether these operands fit the kernel: CPU bf16, q [B, nh, T, d], k and v [B, nkv, T, d], dense last
    dims, nh a multiple of nkv, d a multiple of 16 up to 256. Key and value heads of different widths
    (MLA's 192 and 128) are refused: torch's SDPA runs those through its math path (fp32 probabilities),
    not the flash kernel whose rounding this one reproduces, and would be the more accurate there."""
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.device.type == "cpu" and
               t.dim() == 4 and t.stride(-1) == 1 for t in (q, k, v)):
        return False
    B, nh, T, dk = q.shape
    nkv, dv = k.shape[1], v.shape[-1]
    return (tuple(k.shape) == (B, nkv, T, dk) and tuple(v.shape) == (B, nkv, T, dk) and nkv > 0 and
            nh % nkv == 0 and dk % 16 == 0 and 16 <= dk <= 256 and T > 0)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, threads: int = 0) -> torch.Tensor:
    """Causal GQA attention of q [B, nh, T, d] over k/v [B, nkv, T, d] (any strides but the last):
    [B*T, nh*d] bf16. threads: 0 = the kernel's default."""
    if not is_available():
        raise RuntimeError(_error or "the prefill attention needs the kernel's avx512_bf16 path")
    if not supports(q, k, v):
        raise ValueError(f"causal_attention: unsupported operands q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (see supports())")
    B, nh, T, dk = q.shape
    nkv, dv = k.shape[1], v.shape[-1]
    out = torch.empty(B * T, nh * dv, dtype=torch.bfloat16)
    rc = _lib.lib.fk_causal_attention_bf16(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), B, nh, nkv, T, dk, dv, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), float(scale), out.data_ptr(),
        int(threads))
    if rc != 0:
        raise RuntimeError(f"causal_attention: {_lib.last_error()}")
    return out
