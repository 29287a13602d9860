"""bf16 weights packed for the CPU kernel: `PackedExpert` (the fused SwiGLU expert FFN), `PackedLinear`
and `moe_ffn` (a decode step's experts combined in one call), with the argument checks every binding
shares (tensor dtype, device, shape, contiguity) and 64-byte-aligned buffers."""
from __future__ import annotations

import ctypes
from ctypes import c_void_p

import torch

from . import _lib
from .settings import _threads

_L = _lib.L


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A 64-byte-aligned uint8 tensor of `nbytes` (huge pages advised), not initialised."""
    raw = torch.empty(nbytes + 64, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 64
    buf = raw[off : off + nbytes]
    _L().fk_advise_hugepages(buf.data_ptr(), nbytes)
    return buf


def _check_tensor(name: str, t, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be torch.bfloat16, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")


def _pack(ws: list[torch.Tensor], n: int, k: int) -> torch.Tensor:
    """Packs equally shaped [n, k] matrices into one 64-byte-aligned uint8 buffer."""
    if n < 1 or k < 1:
        raise ValueError(f"weights must not be empty, got shape ({n}, {k})")
    L = _L()
    buf = aligned_buffer(L.fk_packed_bytes(n, k, len(ws)))
    ptrs = (c_void_p * len(ws))(*[w.data_ptr() for w in ws])
    _lib.check(L.fk_pack(ptrs, len(ws), n, k, buf.data_ptr(), 0))
    return buf


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    buf = aligned_buffer(t.numel())
    buf.copy_(t.reshape(-1))
    return buf


def _check_x(x, k: int, what: str) -> int:
    _check_tensor("x", x, 2)
    if x.shape[1] != k:
        raise ValueError(f"x must be [tokens, {k}] for this {what}, got {tuple(x.shape)}")
    return x.shape[0]


def _check_out(out, shape: tuple, dtype: torch.dtype) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype or out.device.type != "cpu" or tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous CPU {dtype} tensor of shape {shape}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )


class PackedExpert:
    """One MoE expert (SwiGLU FFN) packed for the CPU kernel. w1 (gate), w3 (up): [ffn, hidden];
    w2 (down): [hidden, ffn]; bf16 as stored by Hugging Face."""

    def __init__(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor):
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            _check_tensor(name, w, 2)
        ffn, hidden = w1.shape
        if tuple(w3.shape) != (ffn, hidden) or tuple(w2.shape) != (hidden, ffn):
            raise ValueError(
                f"expert shapes disagree: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)} must be [ffn, hidden] "
                f"and w2 {tuple(w2.shape)} must be [hidden, ffn]"
            )
        self.hidden, self.ffn = int(hidden), int(ffn)
        self._w13 = _pack([w1, w3], ffn, hidden)
        self._w2 = _pack([w2], hidden, ffn)
        self.nbytes = self._w13.numel() + self._w2.numel()

    @classmethod
    def from_packed(cls, hidden: int, ffn: int, w13: torch.Tensor, w2: torch.Tensor) -> "PackedExpert":
        """From packed buffers (`packed()` of an expert of this shape), used as they are when 64-byte aligned
        (e.g. pinned host memory the GPU side copies from), else copied."""
        self = cls.__new__(cls)
        self.hidden, self.ffn = int(hidden), int(ffn)
        L = _L()
        for name, t, n, k, g in (("w13", w13, ffn, hidden, 2), ("w2", w2, hidden, ffn, 1)):
            want = L.fk_packed_bytes(n, k, g)
            if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != want or t.device.type != "cpu":
                raise ValueError(f"packed {name} must be {want} uint8 CPU bytes, got {tuple(t.shape)} {t.dtype}")
        self._w13, self._w2 = (t if t.data_ptr() % 64 == 0 and t.is_contiguous() else _aligned_copy(t)
                               for t in (w13, w2))
        self.nbytes = self._w13.numel() + self._w2.numel()
        return self

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed (w13, w2) buffers (fiddler.kernels.layout describes and unpacks them)."""
        return self._w13, self._w2

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        tokens = _check_x(x, self.hidden, "expert")
        nthreads = _threads(threads)
        if out is None:
            out = torch.empty(tokens, self.hidden, dtype=torch.bfloat16)
        else:
            _check_out(out, (tokens, self.hidden), torch.bfloat16)
        if tokens:
            _lib.check(
                _L().fk_expert_ffn(
                    self._w13.data_ptr(), self._w2.data_ptr(), self.hidden, self.ffn,
                    x.data_ptr(), tokens, out.data_ptr(), nthreads,
                )
            )
        return out

    __call__ = forward


class PackedLinear:
    """y = x @ w.T (+ bias) for w [out_features, in_features] bf16 (nn.Linear layout)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None):
        _check_tensor("w", w, 2)
        self.out_features, self.in_features = (int(s) for s in w.shape)
        self.bias = None
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
                raise TypeError("bias must be a floating-point torch.Tensor")
            if tuple(bias.shape) != (self.out_features,) or bias.device.type != "cpu":
                raise ValueError(f"bias must be a CPU tensor of shape ({self.out_features},), got {tuple(bias.shape)}")
            self.bias = bias.to(torch.float32).contiguous()
        self._w = _pack([w], self.out_features, self.in_features)
        self.nbytes = self._w.numel()

    def forward(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None = None,
        threads: int | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
        tokens = _check_x(x, self.in_features, "linear")
        nthreads = _threads(threads)
        if out is None:
            out = torch.empty(tokens, self.out_features, dtype=out_dtype)
        else:
            _check_out(out, (tokens, self.out_features), out_dtype)
        if tokens:
            _lib.check(
                _L().fk_linear(
                    self._w.data_ptr(), self.out_features, self.in_features, x.data_ptr(), tokens,
                    self.bias.data_ptr() if self.bias is not None else None, out.data_ptr(),
                    int(out_dtype == torch.float32), nthreads,
                )
            )
        return out

    __call__ = forward


def _check_experts(experts: list[PackedExpert], x: torch.Tensor) -> tuple[int, int, int]:
    """(hidden, ffn, tokens) of a fused MoE call: at least one expert, all of one shape, x their input."""
    if not experts:
        raise ValueError("moe_ffn needs at least one expert")
    hidden, ffn = experts[0].hidden, experts[0].ffn
    if any(e.hidden != hidden or e.ffn != ffn for e in experts):
        raise ValueError("moe_ffn: experts must share one shape")
    return hidden, ffn, _check_x(x, hidden, "expert")


def _expert_ptrs(experts: list[PackedExpert]):
    """The experts' gate/up and down blocks as the C arrays of pointers the fused calls take."""
    n = len(experts)
    return ((ctypes.c_void_p * n)(*(e._w13.data_ptr() for e in experts)),
            (ctypes.c_void_p * n)(*(e._w2.data_ptr() for e in experts)))


def moe_ffn(experts: list[PackedExpert], weights: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None,
            threads: int | None = None) -> torch.Tensor:
    """The MoE combine of one decode step in one call: sum_e bf16(bf16(experts[e](x)) * weights[e]) for rows
    x [tokens, hidden] that all use the same experts (fp32 sum rounded to bf16 once, like
    `(y * w).sum(dim)` in torch). weights: bf16 [len(experts)]. One pooled region for every expert's
    gate/up pass and one for the down passes (two barriers per layer instead of two per expert)."""
    hidden, ffn, tokens = _check_experts(experts, x)
    _check_tensor("weights", weights, 1)
    if weights.shape[0] != len(experts):
        raise ValueError(f"weights must have one entry per expert ({len(experts)}), got {weights.shape[0]}")
    if out is None:
        out = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    else:
        _check_out(out, (tokens, hidden), torch.bfloat16)
    if tokens:
        n = len(experts)
        p13, p2 = _expert_ptrs(experts)
        _lib.check(_L().fk_moe_ffn(p13, p2, weights.data_ptr(), n, hidden, ffn, x.data_ptr(), tokens,
                                   out.data_ptr(), _threads(threads)))
    return out


def moe_ffn_residual(experts: list[PackedExpert], weights: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                     threads: int | None = None) -> torch.Tensor:
    """residual + moe_ffn(experts, weights, x) in one call, bit-identical to the two (the add rounds as torch's
    bf16 add does): a decode row's experts and the residual stream's add. residual: bf16 like x."""
    hidden, ffn, tokens = _check_experts(experts, x)
    _check_out(residual, tuple(x.shape), torch.bfloat16)
    if weights.dtype != torch.bfloat16 or weights.dim() != 1 or weights.shape[0] != len(experts) \
            or not weights.is_contiguous() or weights.device.type != "cpu":
        raise ValueError(f"weights must be a contiguous CPU bf16 [{len(experts)}], got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    if tokens:
        n = len(experts)
        p13, p2 = _expert_ptrs(experts)
        _lib.check(_L().fk_moe_ffn_residual_bf16(p13, p2, weights.data_ptr(), n, hidden, ffn, x.data_ptr(),
                                                 residual.data_ptr(), tokens, out.data_ptr(), _threads(threads)))
    return out


class ExpertTable:
    """One layer's packed experts ([expert] -> PackedExpert or None) as the pointers the fused calls take,
    gathered and checked once: a decode row's call (`residual_row`) then checks only its row, not every expert
    again, and builds no list of experts."""

    def __init__(self, experts: list[PackedExpert | None]):
        given = [e for e in experts if e is not None]
        if not given or any(not isinstance(e, PackedExpert) for e in given):
            raise ValueError("ExpertTable needs PackedExperts (None where the layer holds none)")
        self.hidden, self.ffn = given[0].hidden, given[0].ffn
        if any(e.hidden != self.hidden or e.ffn != self.ffn for e in given):
            raise ValueError("ExpertTable: experts must share one shape")
        self._experts = list(experts)  # keeps the packed buffers alive while their pointers are held
        self._w13 = [e._w13.data_ptr() if e is not None else None for e in experts]
        self._w2 = [e._w2.data_ptr() if e is not None else None for e in experts]

    def residual_row(self, ids: list[int], weights: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                     threads: int | None = None) -> torch.Tensor:
        """moe_ffn_residual([experts[e] for e in ids], weights, x, residual) for one row x [1, hidden] (the same C
        call, so the same bits). weights: contiguous bf16 with one entry per id."""
        n, shape = len(ids), (1, self.hidden)
        for name, t in (("x", x), ("residual", residual)):
            if not (t.dtype == torch.bfloat16 and t.is_cpu and t.shape == shape and t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous CPU bf16 {shape}, got {t.dtype} {tuple(t.shape)} "
                                 f"on {t.device}")
        if not (weights.dtype == torch.bfloat16 and weights.is_cpu and weights.numel() == n and weights.is_contiguous()):
            raise ValueError(f"weights must be a contiguous CPU bf16 with {n} entries, got {weights.dtype} "
                             f"{tuple(weights.shape)}")
        if n == 0 or min(ids) < 0 or max(ids) >= len(self._w13):
            raise ValueError(f"expert ids {ids} outside the table's [0, {len(self._w13)})")
        p13 = (ctypes.c_void_p * n)(*[self._w13[e] for e in ids])
        if not all(p13):
            raise ValueError(f"expert ids {ids}: the table holds no expert at some of them")
        p2 = (ctypes.c_void_p * n)(*[self._w2[e] for e in ids])
        out = torch.empty(shape, dtype=torch.bfloat16)
        _lib.check(_L().fk_moe_ffn_residual_bf16(p13, p2, weights.data_ptr(), n, self.hidden, self.ffn, x.data_ptr(),
                                                 residual.data_ptr(), 1, out.data_ptr(), _threads(threads)))
        return out
