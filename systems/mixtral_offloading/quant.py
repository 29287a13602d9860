"""Optional HQQ quantization, as Mixtral-Offloading ships Mixtral: attention 4-bit (group 64), experts
2-bit (group 16), through the `hqq` package (Half-Quadratic Quantization). Off by default: the Fiddler
authors ran this baseline unquantized.

Experts are quantized once at load (on the executor's device) and kept in host memory as hqq's packed
W_q plus per-group scale and zero; a cache miss copies exactly those bytes to the GPU side, where the
expert is dequantized with hqq's own `Quantizer.dequantize` and run. Attention projections are replaced
by hqq's `HQQLinear` (PyTorch backend: dequantize, then matmul).

Difference from the original, stated in info(): the original also quantized the scales and zeros to
8 bits (hqq's `quant_scale`/`quant_zero`); hqq >= 0.2 dropped that option, so they are stored in the
compute dtype, which makes a 2-bit expert ~2x larger than in the original (0.5 vs ~0.27 bytes/param).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from systems.base import SystemUnavailable
from fiddler.executors import ExpertWeights, torch_expert

EXPERT_BITS, EXPERT_GROUP = 2, 16
ATTN_BITS, ATTN_GROUP = 4, 64


def require_hqq():
    """hqq's core module, or SystemUnavailable with the reason it cannot be used here."""
    try:
        from hqq.core import quantize as hq
    except Exception as e:  # noqa: BLE001 -- ImportError, or a broken install failing at import
        raise SystemUnavailable(f"quantize: true needs the hqq package (pip install -e \".[offloading]\"): "
                                f"cannot import hqq.core.quantize ({type(e).__name__}: {e})") from e
    return hq


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("hqq")
    except Exception:  # noqa: BLE001
        return None


def _weight_params(hq, nbits: int, group_size: int) -> dict[str, Any]:
    return dict(hq.BaseQuantizeConfig(nbits=nbits, group_size=group_size)["weight_quant_params"])


class HQQExpertCodec:
    """Experts as hqq 2-bit tensors: per weight (w1, w3, w2) the packed W_q, scale and zero."""

    name = "hqq"

    def __init__(self, dtype: torch.dtype, device: torch.device, nbits: int = EXPERT_BITS,
                 group_size: int = EXPERT_GROUP):
        self.hq = require_hqq()
        self.dtype, self.device, self.nbits, self.group_size = dtype, torch.device(device), nbits, group_size
        self.params = _weight_params(self.hq, nbits, group_size)
        self.metas: list[dict[str, Any]] | None = None  # per weight: the tensor-free part of hqq's meta

    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if w.numel() % self.group_size:
            raise ValueError(f"HQQ group size {self.group_size} does not divide a {tuple(w.shape)} expert weight")
        W_q, meta = self.hq.Quantizer.quantize(w.to(self.device, torch.float32), compute_dtype=self.dtype,
                                               device=str(self.device), **self.params)
        return W_q, meta

    def encode(self, e: ExpertWeights) -> tuple[torch.Tensor, ...]:
        out: list[torch.Tensor] = []
        metas = []
        for w in (e.w1, e.w3, e.w2):
            W_q, meta = self._quantize(w)
            out += [W_q.to("cpu").contiguous(), meta["scale"].to("cpu", self.dtype).contiguous(),
                    meta["zero"].to("cpu", self.dtype).contiguous()]
            metas.append({k: v for k, v in meta.items() if not isinstance(v, torch.Tensor)})
        if self.metas is None:
            self.metas = metas
        return tuple(out)

    def dequantize(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """w1, w3, w2 in the compute dtype, by hqq's own dequantization."""
        ws = []
        for i, meta in enumerate(self.metas):
            W_q, scale, zero = tensors[3 * i:3 * i + 3]
            ws.append(self.hq.Quantizer.dequantize(W_q, dict(meta, scale=scale, zero=zero, compute_dtype=self.dtype)))
        return ws

    def forward(self, tensors: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch_expert(ExpertWeights(*self.dequantize(tensors)), x)

    def nbytes(self, config) -> int:
        """Bytes of one quantized expert: packed weights (nbits per parameter) + a scale and a zero per group."""
        params = config.expert_params()
        return params * self.nbits // 8 + 2 * (params // self.group_size) * self.dtype.itemsize

    def info(self) -> dict[str, Any]:
        return {"experts": f"hqq {self.nbits}-bit, group {self.group_size}", "hqq_version": _version(),
                "weight_quant_params": self.params, "scales_zeros": f"{str(self.dtype).replace('torch.', '')} "
                "(the original quantized them to 8 bits; hqq >= 0.2 dropped quant_scale/quant_zero)"}


class HQQAttentionLinear:
    """Stands in for fiddler.model.Linear: y = x W^T with W stored by hqq (4-bit, group 64)."""

    def __init__(self, weight: torch.Tensor, hq, nbits: int = ATTN_BITS, group_size: int = ATTN_GROUP):
        if weight.numel() % group_size:
            raise ValueError(f"HQQ group size {group_size} does not divide a {tuple(weight.shape)} attention weight")
        lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(weight.float())
        cfg = hq.BaseQuantizeConfig(nbits=nbits, group_size=group_size)
        self.layer = hq.HQQLinear(lin, cfg, compute_dtype=weight.dtype, device=str(weight.device))
        self.layer.set_backend(hq.HQQBackend.PYTORCH)
        self.weight = None  # no dense copy is kept
        self.packed = None
        self.nbytes = sum(t.numel() * t.element_size() for t in
                          [self.layer.W_q] + [v for v in self.layer.meta.values() if isinstance(v, torch.Tensor)])

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        # `out` is a hint (fiddler.model.Linear writes into it on its kernel path only); callers use the result
        y = self.layer(x)
        return y if out_dtype is None else y.to(out_dtype)


def quantize_attention(model, nbits: int = ATTN_BITS, group_size: int = ATTN_GROUP) -> dict[str, Any]:
    """Replace the attention projections (fused qkv and o) of every layer of a fiddler MoETransformer by HQQ
    linears. Needs the dense weights: the engine calls the executor's bind_model hook (which calls this)
    before it drops the copies the CPU kernel does not need."""
    hq = require_hqq()
    sizes = {"dense": 0, "quantized": 0}

    def quantized(w: torch.Tensor) -> HQQAttentionLinear:
        h = HQQAttentionLinear(w, hq, nbits, group_size)
        sizes["dense"] += w.numel() * w.element_size()
        sizes["quantized"] += h.nbytes
        return h

    for layer in model.layers:
        layer.qkv_proj = quantized(layer.qkv_proj.weight)
        layer.o_proj = quantized(layer.o_proj.weight)
    dense, quant = sizes["dense"], sizes["quantized"]
    return {"attention": f"hqq {nbits}-bit, group {group_size}", "hqq_version": _version(),
            "projections_per_layer": 2, "dense_bytes": dense, "quantized_bytes": quant}
