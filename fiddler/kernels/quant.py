"""Quantized CPU kernels: llama.cpp's Q8_0 and Q4_0 weight blocks (bit-compatible) in the packed layout
of csrc/fk_quant.h, for linears and expert FFNs.

    blocks = quantize(w, "q4_0")                 # llama.cpp's round-to-nearest, its block bytes
    lin = QuantLinear(blocks, "q4_0", n, k)       # or QuantLinear.from_float(w, "q4_0")
    y = lin(x)                                    # x bf16 [tokens, k] -> bf16 [tokens, n]

Two ways to compute, chosen per CPU at run time (`set_mode`, env var FIDDLER_KERNEL_QMODE):
"a8" quantizes the activations to Q8_0 per 32-block as llama.cpp does on x86 and uses integer dot
products (AVX512-VNNI vpdpbusd, AVX2 pmaddubsw); "w" keeps fp32 activations and dequantizes the
weights in registers (fp32 products and sums). See fiddler/kernels/API.md for the layout and the
measurements behind the default.
"""
from __future__ import annotations

import ctypes
import os
from ctypes import c_void_p

import torch

from . import _lib
from .constants import AMX_MODES, AMX_NEVER, BLOCK_BYTES, QK
from .constants import QUANT_FORMATS as FORMATS, QUANT_ISA_CODES as _ISA_CODES, QUANT_MODES as _MODES
from .constants import row_bytes as _row_bytes
from .packed import _aligned_copy, _check_out, _check_tensor, _check_x, aligned_buffer
from .settings import _threads
from .tuning import tune_amx

_L = _lib.L

__all__ = ["FORMATS", "BLOCK_BYTES", "quantize", "dequantize", "QuantLinear", "QuantExpert", "moe_ffn",
           "set_mode", "mode", "set_amx", "amx", "set_pass_tokens", "pass_tokens", "path", "tune_amx", "row_bytes"]


def _fmt(fmt: str) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quant format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of k weights in llama.cpp's blocks (k padded to 32)."""
    return _row_bytes(fmt, k)


def set_mode(name: str | None = None, isa: str | None = None) -> dict:
    """Selects how quantized weights are computed: "a8", "w", or None/"auto" (this CPU's default),
    on `isa` ("avx512_vnni", "avx2", "generic"; None: the best this CPU runs). Returns mode()."""
    name = (name or "auto").strip().lower()
    if name != "auto" and name not in _MODES:
        raise ValueError(f"unknown quantized mode {name!r}; choose auto, a8 or w")
    if isa is not None and isa not in _ISA_CODES:
        raise ValueError(f"unknown quantized ISA {isa!r}; choose one of {', '.join(_ISA_CODES)}")
    rc = _L().fk_set_qmode(-1 if name == "auto" else _MODES[name], -1 if isa is None else _ISA_CODES[isa])
    if rc != 0:
        raise ValueError(f"cannot select quantized mode {name!r} on {isa or 'auto'}: {_lib.last_error()}")
    return mode()


def mode() -> dict:
    """{"mode": "a8"|"w", "isa": the quantized path, "source": "default" or "set"}."""
    L = _L()
    inv = {v: k for k, v in _MODES.items()}
    isas = {v: k for k, v in _ISA_CODES.items()}
    return {"mode": inv[L.fk_qmode()], "isa": isas[L.fk_qisa()], "source": L.fk_qmode_source().decode()}


_AMX_MODES = {"auto": -1, **AMX_MODES}
AMX_TUNE_CANDIDATES = (4, 8, 12, 16)
_AMX_CHOICE: dict = {"source": "default"}


def set_amx(setting: str = "auto", min_tokens: int | dict | None = None, source: str = "set_amx") -> dict:
    """AMX-INT8 tile products for the a8 mode on the AVX-512 VNNI path: "auto" (on where the CPU has
    amx_int8 and the tile kernel's self-check agrees with the vector one), "on", "off", or "emulated" (the
    same tiling on a software model of the tiles, to test it on any AVX-512 VNNI CPU). A row-group call of
    at least `min_tokens` tokens takes the tiles, fewer the vector kernel; both give the same bits.
    min_tokens: an int for both formats or {"q8_0": n, "q4_0": n}, each in 1..16, or AMX_NEVER; None: the
    per-format default. Returns amx()."""
    if setting not in _AMX_MODES:
        raise ValueError(f"unknown AMX mode {setting!r}; choose one of {', '.join(_AMX_MODES)}")
    per = min_tokens if isinstance(min_tokens, dict) else {f: min_tokens for f in FORMATS}
    if set(per) - set(FORMATS):
        raise ValueError(f"min_tokens: unknown formats {sorted(set(per) - set(FORMATS))}")
    for f, n in per.items():
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= AMX_NEVER):
            raise ValueError(f"min_tokens must be in 1..{AMX_NEVER} ({AMX_NEVER}: never), got {n!r} for {f}")
    rc = _L().fk_set_qamx(_AMX_MODES[setting], per.get("q8_0") or 0, per.get("q4_0") or 0)
    if rc != 0:
        raise ValueError(f"cannot set the quantized AMX mode {setting!r}: {_lib.last_error()}")
    _AMX_CHOICE.clear()
    _AMX_CHOICE["source"] = source if any(per.values()) else "default"
    return amx()


def amx() -> dict:
    """{"amx": "on"|"emulated"|"off" (in effect: off unless the path is avx512_vnni in a8 mode),
    "min_tokens": {format: n}, "status": the self-check's verdict ("ok", "not checked" or why the tiles are
    off), "source": where min_tokens came from (+ "ms": {format: {tokens: (amx, vector)}} from tune_amx)}."""
    L = _L()
    inv = {v: k for k, v in AMX_MODES.items()}
    return {"amx": inv[L.fk_qamx()], "min_tokens": {f: L.fk_qamx_min_tokens(c) for f, c in FORMATS.items()},
            "status": L.fk_qamx_status().decode(), **_AMX_CHOICE}


def set_pass_tokens(tokens: int | None = None, source: str = "set_pass_tokens") -> dict:
    """Tokens a pass of the AVX-512 VNNI a8 kernel takes at 9-16 tokens a call: 16 (one pass: the fp32 sums
    past 8 spill, the block's weights are loaded once) or 8 (two passes, all sums in registers); None: this
    CPU's default (the per-vendor table of csrc/fk_tuning.cpp: Intel 16, others 8). Every setting gives the
    same bits; only the speed differs. Env var FIDDLER_KERNEL_QPASS. Returns pass_tokens()."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens not in (8, 16)):
        raise ValueError(f"tokens a pass must be 8 or 16 (None: this CPU's default), got {tokens!r}")
    _lib.check(_L().fk_set_qpass(tokens or 0, source.encode()))
    return pass_tokens()


def pass_tokens() -> dict:
    """{"tokens": 8|16, "source": the per-vendor table's reason, or who set it}."""
    L = _L()
    return {"tokens": L.fk_qpass(), "source": L.fk_qpass_source().decode()}


def path(tokens: int, fmt: str) -> str:
    """The path a call of `tokens` tokens on `fmt` weights runs, e.g. "avx512_vnni:a8" or
    "avx512_vnni+amx:a8" (tile products for its token groups of at least amx()["min_tokens"][fmt])."""
    m, a = mode(), amx()
    tiles = {"on": "+amx", "emulated": "+amx_emulated"}.get(a["amx"], "")
    _fmt(fmt)
    return f"{m['isa']}{tiles if min(tokens, 16) >= a['min_tokens'][fmt] else ''}:{m['mode']}"


# ------------------------------------------------------------------ quantize / dequantize
def quantize(w: torch.Tensor, fmt: str, threads: int | None = None) -> torch.Tensor:
    """llama.cpp's round-to-nearest quantization (quantize_row_q8_0_ref / quantize_row_q4_0_ref) of the
    rows of w [n, k] (any float dtype, taken as fp32; k is zero-padded to a multiple of 32). Returns the
    block bytes, uint8 [n, row_bytes(fmt, k)], exactly what a GGUF file stores for that tensor."""
    code = _fmt(fmt)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise TypeError("quantize needs a 2-D floating-point tensor")
    n, k = w.shape
    kp = (k + QK - 1) // QK * QK
    x = torch.zeros(n, kp, dtype=torch.float32)
    x[:, :k] = w.detach().to("cpu", torch.float32)
    out = torch.empty(n, row_bytes(fmt, k), dtype=torch.uint8)
    _lib.check(_L().fk_quantize_rows(code, x.data_ptr(), n, kp, out.data_ptr(), _threads(threads)))
    return out


def dequantize(blocks: torch.Tensor, fmt: str, k: int | None = None, dtype=torch.float32) -> torch.Tensor:
    """The weights of llama.cpp blocks uint8 [n, nblocks * block bytes] (any device): Q8_0 q * d,
    Q4_0 (nibble - 8) * d, computed in fp32 like ggml's dequantize_row_*; the first k columns."""
    _fmt(fmt)
    bb = BLOCK_BYTES[fmt]
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, bb)
    d = b[..., :2].contiguous().view(torch.float16).to(torch.float32)  # [n, nb, 1]
    if fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    else:
        qs = b[..., 2:].to(torch.int16)
        q = (torch.cat([qs & 15, qs >> 4], dim=-1) - 8).to(torch.float32)
    w = (q * d).reshape(n, -1)
    return (w if k is None else w[:, :k]).to(dtype)


def _check_blocks(blocks: torch.Tensor, fmt: str, n: int, k: int) -> None:
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.device.type != "cpu":
        raise TypeError("blocks must be a CPU torch.uint8 tensor of llama.cpp blocks")
    if tuple(blocks.shape) != (n, row_bytes(fmt, k)) or not blocks.is_contiguous():
        raise ValueError(f"blocks must be contiguous [{n}, {row_bytes(fmt, k)}] for {fmt} [{n}, {k}], "
                         f"got {tuple(blocks.shape)}")


def _qpack(fmt: str, blocks: list[torch.Tensor], n: int, k: int) -> torch.Tensor:
    if n < 1 or k < 1:
        raise ValueError(f"weights must not be empty, got shape ({n}, {k})")
    for b in blocks:
        _check_blocks(b, fmt, n, k)
    L = _L()
    kb = (k + QK - 1) // QK * QK
    buf = aligned_buffer(L.fk_qpacked_bytes(FORMATS[fmt], n, kb, len(blocks)))
    ptrs = (c_void_p * len(blocks))(*[b.data_ptr() for b in blocks])
    _lib.check(L.fk_qpack(FORMATS[fmt], ptrs, len(blocks), n, kb, buf.data_ptr(), 0))
    return buf


def _qunpack(fmt: str, packed: torch.Tensor, groups: int, g: int, n: int, k: int) -> torch.Tensor:
    out = torch.empty(n, row_bytes(fmt, k), dtype=torch.uint8)
    kb = (k + QK - 1) // QK * QK
    _lib.check(_L().fk_qunpack(FORMATS[fmt], packed.data_ptr(), groups, g, n, kb, out.data_ptr()))
    return out


# ------------------------------------------------------------------ packed quantized weights
class QuantLinear:
    """y = x @ W.T (+ bias) for W given as llama.cpp blocks uint8 [n, row_bytes(fmt, k)]; x bf16 or fp32
    [tokens, k]; y bf16 or fp32 (out_dtype). Same call interface as fiddler.kernels.PackedLinear."""

    def __init__(self, blocks: torch.Tensor, fmt: str, n: int, k: int, bias: torch.Tensor | None = None):
        _fmt(fmt)
        self.fmt, self.out_features, self.in_features = fmt, int(n), int(k)
        self._w = _qpack(fmt, [blocks], self.out_features, self.in_features)
        self.nbytes = self._w.numel()  # bytes streamed per call (scales included)
        self.bias = None if bias is None else bias.to(torch.float32).contiguous()
        if self.bias is not None and tuple(self.bias.shape) != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(self.bias.shape)}")

    @classmethod
    def from_float(cls, w: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> "QuantLinear":
        return cls(quantize(w, fmt), fmt, w.shape[0], w.shape[1], bias)

    def blocks(self) -> torch.Tensor:
        """The llama.cpp block bytes back from the packed copy (bit for bit what was packed)."""
        return _qunpack(self.fmt, self._w, 1, 0, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None, threads: int | None = None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
        tokens, x_f32 = _check_qx(x, self.in_features, "linear")
        if out is None:
            out = torch.empty(tokens, self.out_features, dtype=out_dtype)
        else:
            _check_out(out, (tokens, self.out_features), out_dtype)
        if tokens:
            _lib.check(_L().fk_qlinear(
                FORMATS[self.fmt], self._w.data_ptr(), self.out_features, self.in_features, x.data_ptr(), x_f32, tokens,
                self.bias.data_ptr() if self.bias is not None else None, out.data_ptr(),
                int(out_dtype == torch.float32), _threads(threads)))
        return out

    __call__ = forward


class QuantExpert:
    """The SwiGLU expert y = W2 (silu(W1 x) * (W3 x)) on quantized weights: w1, w3 blocks of [ffn, hidden],
    w2 blocks of [hidden, ffn]. Same call interface as fiddler.kernels.PackedExpert."""

    def __init__(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, fmt: str, hidden: int, ffn: int):
        _fmt(fmt)
        self.fmt, self.hidden, self.ffn = fmt, int(hidden), int(ffn)
        self._w13 = _qpack(fmt, [w1, w3], self.ffn, self.hidden)
        self._w2 = _qpack(fmt, [w2], self.hidden, self.ffn)
        self.nbytes = self._w13.numel() + self._w2.numel()

    @classmethod
    def from_float(cls, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, fmt: str) -> "QuantExpert":
        ffn, hidden = w1.shape
        return cls(quantize(w1, fmt), quantize(w3, fmt), quantize(w2, fmt), fmt, hidden, ffn)

    @classmethod
    def from_packed(cls, fmt: str, hidden: int, ffn: int, w13: torch.Tensor, w2: torch.Tensor) -> "QuantExpert":
        """From packed buffers (`packed()`), used as they are when 64-byte aligned (e.g. pinned host memory the
        GPU side copies from), else copied (e.g. read from the engine's on-disk cache)."""
        self = cls.__new__(cls)
        self.fmt, self.hidden, self.ffn = fmt, int(hidden), int(ffn)
        L = _L()
        for name, t, n, k, g in (("w13", w13, ffn, hidden, 2), ("w2", w2, hidden, ffn, 1)):
            want = L.fk_qpacked_bytes(FORMATS[fmt], n, (k + QK - 1) // QK * QK, g)
            if t.dtype != torch.uint8 or t.numel() != want:
                raise ValueError(f"packed {name} must be {want} uint8 bytes, got {t.numel()} {t.dtype}")
        self._w13, self._w2 = (t if t.data_ptr() % 64 == 0 and t.is_contiguous() and t.dim() == 1 else _aligned_copy(t)
                               for t in (w13, w2))
        self.nbytes = self._w13.numel() + self._w2.numel()
        return self

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._w13, self._w2

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) as llama.cpp block bytes, bit for bit what was packed."""
        return (_qunpack(self.fmt, self._w13, 2, 0, self.ffn, self.hidden),
                _qunpack(self.fmt, self._w13, 2, 1, self.ffn, self.hidden),
                _qunpack(self.fmt, self._w2, 1, 0, self.hidden, self.ffn))

    def dequantized(self, dtype=torch.float32):
        """(w1, w3, w2) dequantized (for references and for a GPU side that computes in dense form)."""
        w1, w3, w2 = self.blocks()
        return (dequantize(w1, self.fmt, self.hidden, dtype), dequantize(w3, self.fmt, self.hidden, dtype),
                dequantize(w2, self.fmt, self.ffn, dtype))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        tokens, x_f32 = _check_qx(x, self.hidden, "expert")
        if out is None:
            out = torch.empty(tokens, self.hidden, dtype=torch.bfloat16)
        else:
            _check_out(out, (tokens, self.hidden), torch.bfloat16)
        if tokens:
            _lib.check(_L().fk_qexpert_ffn(FORMATS[self.fmt], self._w13.data_ptr(), self._w2.data_ptr(), self.hidden,
                                           self.ffn, x.data_ptr(), x_f32, tokens, out.data_ptr(), _threads(threads)))
        return out

    __call__ = forward


def _check_qx(x, k: int, what: str) -> tuple[int, int]:
    """(tokens, 1 if x is fp32 else 0): quantized linears and experts take bf16 or fp32 activations (fp32 ones
    are quantized to Q8_0 from fp32, as llama.cpp does; the w mode computes with them as they are)."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        if x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous 2-D CPU tensor, got {tuple(x.shape)} on {x.device}")
        if x.shape[1] != k:
            raise ValueError(f"x must be [tokens, {k}] for this {what}, got {tuple(x.shape)}")
        return x.shape[0], 1
    return _check_x(x, k, what), 0


def moe_ffn(experts: list[QuantExpert], weights: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None,
            threads: int | None = None) -> torch.Tensor:
    """fiddler.kernels.moe_ffn for quantized experts of one format (same combine roundings)."""
    if not experts:
        raise ValueError("moe_ffn needs at least one expert")
    e0 = experts[0]
    if any(e.hidden != e0.hidden or e.ffn != e0.ffn or e.fmt != e0.fmt for e in experts):
        raise ValueError("moe_ffn: experts must share one shape and format")
    tokens, x_f32 = _check_qx(x, e0.hidden, "expert")
    _check_tensor("weights", weights, 1)
    if weights.shape[0] != len(experts):
        raise ValueError(f"weights must have one entry per expert ({len(experts)}), got {weights.shape[0]}")
    if out is None:
        out = torch.empty(tokens, e0.hidden, dtype=torch.bfloat16)
    else:
        _check_out(out, (tokens, e0.hidden), torch.bfloat16)
    if tokens:
        n = len(experts)
        p13 = (ctypes.c_void_p * n)(*(e._w13.data_ptr() for e in experts))
        p2 = (ctypes.c_void_p * n)(*(e._w2.data_ptr() for e in experts))
        _lib.check(_L().fk_qmoe_ffn(FORMATS[e0.fmt], p13, p2, weights.data_ptr(), n, e0.hidden, e0.ffn, x.data_ptr(),
                                    x_f32, tokens, out.data_ptr(), _threads(threads)))
    return out


if _lib.lib is not None and os.environ.get("FIDDLER_KERNEL_QMODE"):
    set_mode(os.environ["FIDDLER_KERNEL_QMODE"])
if _lib.lib is not None and os.environ.get("FIDDLER_KERNEL_QPASS"):
    _qpass = os.environ["FIDDLER_KERNEL_QPASS"].strip().lower()
    if _qpass not in ("auto", "8", "16"):
        raise ValueError(f"FIDDLER_KERNEL_QPASS must be auto, 8 or 16, got {os.environ['FIDDLER_KERNEL_QPASS']!r}")
    set_pass_tokens(None if _qpass == "auto" else int(_qpass), source="FIDDLER_KERNEL_QPASS")
