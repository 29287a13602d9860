"""Fused per-token ops of a bf16 CPU decode step (csrc/fk_decode.cpp), one ctypes call each.

* `rms_norm(x, weight, eps, out=None)`: fiddler.model.rms_norm for bf16, bit-exact.
* `rms_norm_f32(x, weight, eps, out=None)`: fiddler.model.rms_norm_f32 (bf16 x, fp32 weight and result), bit-exact.
* `rope_attention_decode(qkv, pos, cos, sin, k_cache, v_cache, ...)`: rope on the new token's q and k
  (bit-exact), k/v written into the KV cache at `pos`, single-query GQA attention over positions
  [0, pos] (or the sliding window), output [B, num_heads * head_dim] as o_proj reads it.
* `DecodeAttention`: the same bound to one model's KV cache and rope tables, validated once, for the
  hot path (a few microseconds of Python per call).
* `DecodeBlock`: a whole decoder layer's attention half (norm, q/k/v projection, rope + attention, o
  projection, residual add) and its MoE half's inputs (norm, router logits) in one call, bit-identical to
  those ops called one by one; for quantized projections (fiddler.kernels.quant.QuantLinear) with the
  model's fp32 activations too, the router then left to the caller.

A decode step used to spend ~40 torch ops per layer on these (rms_norm 8, rope ~14, two index_put
cache writes, SDPA, reshapes); each costs 5-140 us of dispatch on a small CPU, more than the math.
Numerics against the torch ops: see fk_decode.cpp and tests/test_decode_fastpath.py.
"""
from __future__ import annotations

import torch

from . import _lib
from .constants import QUANT_FORMATS

__all__ = ["DecodeAttention", "DecodeBlock", "is_available", "load_error", "rms_norm", "rms_norm_f32",
           "rope_attention_decode"]

_BF16 = torch.bfloat16
_ok = _lib.lib is not None
_error = None if _ok else f"fiddler.kernels unavailable: {_lib.load_error}"
if _ok:
    _rmsnorm = _lib.lib.fk_rmsnorm_bf16
    _rope_attn = _lib.lib.fk_rope_attn_decode_bf16
    _rope_attn_rows = _lib.lib.fk_rope_attn_decode_rows_bf16
    _rmsnorm_f32 = _lib.lib.fk_rmsnorm_f32
    _block = _lib.lib.fk_decode_attn_block_bf16
    _block_q = _lib.lib.fk_decode_attn_block_q


def is_available() -> bool:
    """Whether the compiled library has the decode ops."""
    return _ok


def load_error() -> str | None:
    return _error


def _check(rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"fiddler.kernels.decode: {_lib.last_error()}")


def _need():
    if not _ok:
        raise RuntimeError(_error)


def _check_bf16(name: str, t, dim: int | None = None, dtype: torch.dtype = _BF16) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")


def _check_out(out, shape: tuple) -> None:
    _check_bf16("out", out)
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * bf16(x * rsqrt(mean(x^2) + eps)) over the last dim, for bf16 x [..., n] and weight [n];
    bit-exact with fiddler.model.rms_norm. `out` (same shape as x) may be x itself."""
    _need()
    _check_bf16("x", x)
    _check_bf16("weight", weight, 1)
    n = weight.shape[0]
    if x.dim() < 1 or x.shape[-1] != n or n == 0:
        raise ValueError(f"x must be [..., {n}] to match weight, got {tuple(x.shape)}")
    if out is None:
        out = torch.empty_like(x)
    else:
        _check_out(out, tuple(x.shape))
    rows = x.numel() // n
    if rows:
        _check(_rmsnorm(x.data_ptr(), weight.data_ptr(), rows, n, eps, out.data_ptr()))
    return out


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """fp32(x * rsqrt(mean(x^2) + eps)) * weight in fp32 over the last dim, for bf16 x [..., n] and an fp32
    weight [n]: fiddler.model.rms_norm_f32 (torch's F.rms_norm of x.float()), bit-exact; fp32 result."""
    _need()
    _check_bf16("x", x)
    _check_bf16("weight", weight, 1, torch.float32)
    n = weight.shape[0]
    if x.dim() < 1 or x.shape[-1] != n or n == 0:
        raise ValueError(f"x must be [..., {n}] to match weight, got {tuple(x.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32)
    else:
        _check_bf16("out", out, None, torch.float32)
        if out.shape != x.shape:
            raise ValueError(f"out must have shape {tuple(x.shape)}, got {tuple(out.shape)}")
    rows = x.numel() // n
    if rows:
        _check(_rmsnorm_f32(x.data_ptr(), weight.data_ptr(), rows, n, eps, out.data_ptr()))
    return out


def _check_cache(k_cache, v_cache) -> tuple[int, int, int, int]:
    _check_bf16("k_cache", k_cache, 4)
    _check_bf16("v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    return tuple(int(s) for s in k_cache.shape)  # max_batch, nkv, max_seq, d


def _check_tables(cos, sin, max_seq: int, d: int) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        _check_bf16(name, t, 2)
        if t.shape[0] < max_seq or t.shape[1] != d:
            raise ValueError(f"{name} must be [>= {max_seq}, {d}] (positions x head_dim), got {tuple(t.shape)}")


class DecodeAttention:
    """rope + KV-cache write + attention for one model: `k_cache`/`v_cache` [layers, max_batch, kv_heads,
    max_seq, head_dim] and the rope tables are validated here once; each call checks only its qkv/out."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 num_heads: int, sliding_window: int | None = None):
        _need()
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            _check_bf16(name, t, 5)
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
        layers, self.max_batch, self.nkv, self.max_seq, self.d = (int(s) for s in k_cache.shape)
        if num_heads < 1 or num_heads % self.nkv:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({self.nkv})")
        if self.d % 2:
            raise ValueError(f"head_dim ({self.d}) must be even for rotary embeddings")
        _check_tables(cos, sin, self.max_seq, self.d)
        self.nh, self.layers = int(num_heads), layers
        self.width = (self.nh + 2 * self.nkv) * self.d
        self.window = int(sliding_window or 0)
        self.scale = self.d**-0.5
        # kept alive (only their addresses are used below) and visible, so owners can check the binding
        self.k_cache, self.v_cache, self.cos, self.sin = k_cache, v_cache, cos, sin
        layer_bytes = k_cache.stride(0) * k_cache.element_size()
        self._k = [k_cache.data_ptr() + i * layer_bytes for i in range(layers)]
        self._v = [v_cache.data_ptr() + i * layer_bytes for i in range(layers)]
        self._cos, self._sin = cos.data_ptr(), sin.data_ptr()

    def __call__(self, layer: int, qkv: torch.Tensor, pos: int, out: torch.Tensor) -> torch.Tensor:
        """qkv [B, (nh + 2 nkv) d] bf16 contiguous (B <= max_batch) -> out [B, nh d] bf16 contiguous."""
        self._check_io(qkv, out)
        if not 0 <= pos < self.max_seq:
            raise ValueError(f"pos {pos} outside the KV cache [0, {self.max_seq})")
        _check(_rope_attn(qkv.data_ptr(), qkv.shape[0], self.nh, self.nkv, self.d, pos, self._cos, self._sin,
                          self._k[layer], self._v[layer], self.max_batch, self.max_seq, self.window, self.scale,
                          out.data_ptr()))
        return out

    def rows(self, layer: int, qkv: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, out: torch.Tensor
             ) -> torch.Tensor:
        """Like calling it once per row b at position pos[b] on cache row rows[b] (distinct; int64 CPU
        tensors [B]), in one call: continuous batching's decode step. Row b's output is bit-identical to
        that one-row call's."""
        self._check_io(qkv, out)
        B = qkv.shape[0]
        for name, t in (("pos", pos), ("rows", rows)):
            if t.dtype != torch.int64 or tuple(t.shape) != (B,) or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous CPU int64 [{B}], got {t.dtype} {tuple(t.shape)}")
        if B and (int(pos.min()) < 0 or int(pos.max()) >= self.max_seq):
            raise ValueError(f"positions {pos.tolist()} outside the KV cache [0, {self.max_seq})")
        r = rows.tolist()
        if B and (min(r) < 0 or max(r) >= self.max_batch or len(set(r)) != B):
            raise ValueError(f"cache rows {rows.tolist()} must be distinct and in [0, {self.max_batch})")
        _check(_rope_attn_rows(qkv.data_ptr(), B, self.nh, self.nkv, self.d, pos.data_ptr(), rows.data_ptr(),
                               self._cos, self._sin, self._k[layer], self._v[layer], self.max_batch, self.max_seq,
                               self.window, self.scale, out.data_ptr()))
        return out

    def _check_io(self, qkv: torch.Tensor, out: torch.Tensor) -> None:
        B = qkv.shape[0]
        if (qkv.dtype != _BF16 or out.dtype != _BF16 or qkv.dim() != 2 or qkv.shape[1] != self.width
                or tuple(out.shape) != (B, self.nh * self.d) or not (qkv.is_contiguous() and out.is_contiguous())
                or qkv.device.type != "cpu" or out.device.type != "cpu"):
            raise ValueError(
                f"qkv must be a contiguous CPU bf16 [B, {self.width}] and out [B, {self.nh * self.d}]; got qkv "
                f"{qkv.dtype} {tuple(qkv.shape)}, out {out.dtype} {tuple(out.shape)}")


def rope_attention_decode(qkv: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, *, num_heads: int,
                          sliding_window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of attention for B rows (one new token each, at position `pos`).

    qkv [B, (num_heads + 2 kv_heads) * d]: fused q/k/v projection of the new tokens; cos/sin [>= max_seq, d]
    rope tables; k_cache/v_cache [max_batch, kv_heads, max_seq, d] (one layer), written at `pos` for
    rows < B. Returns out [B, num_heads * d] = softmax(q k^T / sqrt(d)) v per head over keys [0, pos]
    (keys > pos - sliding_window with a window)."""
    _need()
    _check_bf16("qkv", qkv, 2)
    max_batch, nkv, max_seq, d = _check_cache(k_cache, v_cache)
    if num_heads < 1 or num_heads % nkv:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({nkv})")
    if d % 2:
        raise ValueError(f"head_dim ({d}) must be even for rotary embeddings")
    B, width = qkv.shape
    if width != (num_heads + 2 * nkv) * d:
        raise ValueError(f"qkv must be [B, {(num_heads + 2 * nkv) * d}] for {num_heads} heads, {nkv} KV heads "
                         f"of dim {d}; got {tuple(qkv.shape)}")
    if not 1 <= B <= max_batch:
        raise ValueError(f"qkv has {B} rows; the cache holds 1..{max_batch}")
    if not isinstance(pos, int) or not 0 <= pos < max_seq:
        raise ValueError(f"pos must be an int in [0, {max_seq}), got {pos!r}")
    _check_tables(cos, sin, pos + 1, d)
    if out is None:
        out = torch.empty(B, num_heads * d, dtype=_BF16)
    else:
        _check_out(out, (B, num_heads * d))
    _check(_rope_attn(qkv.data_ptr(), B, num_heads, nkv, d, pos, cos.data_ptr(), sin.data_ptr(),
                      k_cache.data_ptr(), v_cache.data_ptr(), max_batch, max_seq, int(sliding_window or 0),
                      d**-0.5, out.data_ptr()))
    return out


class DecodeBlock:
    """fk_decode_attn_block_bf16 bound to one model: per layer i, with h = rms_norm(x, norm1),
    x_out = x + o_proj(attention(qkv_proj(h))), h2 = rms_norm(x_out, norm2), logits = router(h2): the
    decode step's seven calls of that layer in one, every output bit-identical to them (the same C
    functions on the same buffers). `layers`: per layer (norm1, norm2, qkv, o, router, q_norm, k_norm), the
    norms bf16 [hidden] weights, the projections fiddler.kernels.PackedLinear (router without a bias; None for
    a dense layer, whose logits are then None), q_norm and k_norm bf16 [head_dim] for Qwen3's per-head q/k
    RMSNorms after the projection (both None: none); validated here once, with the DecodeAttention that
    holds the cache and rope tables.

    Quantized projections (fiddler.kernels.quant.QuantLinear, one format for all, no biases) with fp32 norm
    weights take fk_decode_attn_block_q: the model's fp32 activations (rms_norm_f32 into q/k/v, h2 fp32), the
    router (None in every layer: an fp32 one stays the caller's) not in the call, logits None."""

    def __init__(self, attention: DecodeAttention, layers: list[tuple], eps: float):
        _need()
        if len(layers) != attention.layers:
            raise ValueError(f"{len(layers)} layers for a cache of {attention.layers}")
        a = attention
        self.attention, self.eps = a, float(eps)
        self.hidden = layers[0][3].out_features
        fmts = {getattr(lin, "fmt", None) for _, _, qkv, o, r, *_ in layers for lin in (qkv, o, r) if lin is not None}
        if len(fmts) != 1:
            raise ValueError(f"one weight format for every projection, got {sorted(map(str, fmts))}")
        self.fmt = fmts.pop()  # None: bf16 PackedLinear; else a QuantLinear's format
        if self.fmt is not None and any(r is not None for *_, r, _, _ in layers):
            raise ValueError("quantized projections: the router is the caller's (an fp32 one), not the block's")
        norm_dtype = _BF16 if self.fmt is None else torch.float32
        routers = [r for *_, r, _, _ in layers if r is not None]
        self.experts = routers[0].out_features if routers else 1
        H, W = self.hidden, a.width
        self._layers = []
        for i, (n1, n2, qkv, o, router, qn, kn) in enumerate(layers):
            for name, w in (("norm1", n1), ("norm2", n2)):
                _check_bf16(f"layer {i} {name}", w, 1, norm_dtype)
                if w.shape[0] != H:
                    raise ValueError(f"layer {i} {name} must be [{H}], got {tuple(w.shape)}")
            if (qn is None) != (kn is None):
                raise ValueError(f"layer {i}: q_norm and k_norm come together")
            for name, w in (("q_norm", qn), ("k_norm", kn)):
                if w is not None:
                    _check_bf16(f"layer {i} {name}", w, 1)
                    if w.shape[0] != a.d:
                        raise ValueError(f"layer {i} {name} must be [{a.d}] (per head), got {tuple(w.shape)}")
            for name, lin, n, k in (("qkv", qkv, W, H), ("o", o, H, a.nh * a.d), ("router", router, self.experts, H)):
                if lin is not None and (lin.out_features, lin.in_features) != (n, k):
                    raise ValueError(f"layer {i} {name} must be [{n}, {k}], got [{lin.out_features}, {lin.in_features}]")
            if router is not None and router.bias is not None:
                raise ValueError("a router with a bias is not what the block computes")
            if self.fmt is not None and (qkv.bias is not None or o.bias is not None):
                raise ValueError("quantized projections with a bias are not what the block computes")
            bias = [lin.bias.data_ptr() if lin.bias is not None else None for lin in (qkv, o)]
            # the buffers stay alive with the model's Linears and norms; only their addresses are kept
            self._layers.append((n1.data_ptr(), n2.data_ptr(), qkv._w.data_ptr(), bias[0], o._w.data_ptr(), bias[1],
                                 router._w.data_ptr() if router is not None else None,
                                 self.experts if router is not None else 0,
                                 qn.data_ptr() if qn is not None else None, kn.data_ptr() if kn is not None else None))
        self._bufs: dict[int, tuple] = {}

    def _buffers(self, B: int) -> tuple:
        """This block's own scratch and outputs for B rows (reused every call: valid until the next): h, qkv,
        att, o, x_out, h2, logits (h and h2 fp32 for quantized projections)."""
        b = self._bufs.get(B)
        if b is None:
            a, H = self.attention, self.hidden
            act = _BF16 if self.fmt is None else torch.float32
            shapes = (((B, H), act), ((B, a.width), _BF16), ((B, a.nh * a.d), _BF16), ((B, H), _BF16),
                      ((B, H), _BF16), ((B, H), act), ((B, self.experts), _BF16))
            t = [torch.empty(s, dtype=dt) for s, dt in shapes]
            b = self._bufs[B] = (t, [x.data_ptr() for x in t])
        return b

    def __call__(self, layer: int, x: torch.Tensor, pos, rows, threads: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [B, hidden] bf16 contiguous; pos, rows: ctypes int64 arrays [B] (positions; distinct cache rows,
        as the model's segments are). Returns (x_out, h2, logits) in buffers the next call reuses."""
        a, B = self.attention, x.shape[0]
        if (x.dtype != _BF16 or x.dim() != 2 or x.shape[1] != self.hidden or not x.is_contiguous()
                or x.device.type != "cpu" or not 1 <= B <= a.max_batch):
            raise ValueError(f"x must be a contiguous CPU bf16 [1..{a.max_batch}, {self.hidden}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        (_, _, _, _, x_out, h2, logits), (h, qkv, att, o, px, ph2, pl) = self._buffers(B)
        n1, n2, wqkv, bqkv, wo, bo, wr, experts, qn, kn = self._layers[layer]
        if self.fmt is not None:
            _check(_block_q(QUANT_FORMATS[self.fmt], x.data_ptr(), B, self.hidden, n1, n2, self.eps, wqkv, qn, kn, wo, a.nh,
                            a.nkv, a.d, pos, rows, a._cos, a._sin, a._k[layer], a._v[layer], a.max_batch,
                            a.max_seq, a.window, a.scale, h, qkv, att, o, px, ph2, threads))
            return x_out, h2, None
        _check(_block(x.data_ptr(), B, self.hidden, n1, n2, self.eps, wqkv, bqkv, qn, kn, wo, bo, wr, experts, a.nh,
                      a.nkv, a.d, pos, rows, a._cos, a._sin, a._k[layer], a._v[layer], a.max_batch, a.max_seq,
                      a.window, a.scale, h, qkv, att, o, px, ph2, pl, threads))
        return x_out, h2, logits if experts else None
