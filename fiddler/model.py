"""The forward pass of every supported MoE family in plain PyTorch: one generic decoder.

Op order and dtypes follow transformers' (5.24) modeling_mixtral, modeling_qwen3_moe, modeling_qwen2_moe,
modeling_olmoe, modeling_deepseek_v2 and modeling_deepseek_v3 so that fp32 results agree to rounding
and bf16 results to bf16 noise: RMSNorm in fp32 then cast back, rope tables built in fp32 and cast to
the model dtype, router scores in fp32. What differs between families is data (fiddler.config.MoEConfig):
the attention kind (`GQAAttention`: optional q/k/v biases and q/k norms; `MLAAttention`: DeepSeek's
multi-head latent attention), the router (`route`: softmax or sigmoid, greedy or grouped top-k, bias
correction, renormalisation, scaling), shared experts and dense layers.

Expert FFNs are not computed here: the MoE block hands (tokens, expert ids, weights) to an executor
(fiddler.executors), which decides where each expert runs (the Fiddler part). Shared experts go to the
executor as expert slots after the routed ones (config.expert_slots), routed for every token.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import MoEConfig
from .executors.contract import ExpertExecutor
from .executors.ffn import torch_expert
from .kernel_loader import (KERNEL_EVERY_COUNT, decode_kernels_error, load_decode_kernels, load_kernels,
                            load_route_kernels)
from .step import Segment
from .threads import small_call_threads, torch_threads
from .weights import ExpertWeights, ModelWeights


class Linear:
    """y = x @ w.T. On the CPU in bf16 it uses the packed AVX512-BF16 kernel (torch's bf16 GEMV is far from
    the memory limit); otherwise, and for token counts above `kernel_max_tokens` where oneDNN/AMX matmul
    may win (decided by measurement, see `choose_kernel_max_tokens`), torch. `weight` is None once the
    kernel serves every token count (the engine drops torch's copy)."""

    kernel_max_tokens: int = KERNEL_EVERY_COUNT  # default; the Engine sets it per model from a measurement

    def __init__(self, weight: torch.Tensor, *, use_kernel: bool | None = None, bias: torch.Tensor | None = None):
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        k = load_kernels()
        if use_kernel is None:
            use_kernel = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        self.packed = k.PackedLinear(weight, bias) if (use_kernel and k is not None) else None
        self.threads: int | None = None

    def packed_threads(self) -> int:
        """The thread count the packed kernel's call takes (0: the library's default)."""
        return self.threads or 0

    def uses_torch(self, tokens: int) -> bool:
        return self.packed is None or tokens > self.kernel_max_tokens

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out` (kernel path only): a preallocated [tokens, out_features] result buffer to write into."""
        if not self.uses_torch(x.shape[0]):
            return self.packed.forward(x, out=out, threads=self.threads, out_dtype=out_dtype or x.dtype)
        y = F.linear(x, self.weight, self.bias)
        return y if out_dtype is None else y.to(out_dtype)


def linear_add(lin, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + lin(x): one GEMM that adds the residual (addmm) where torch serves a bias-free Linear in the
    residual's dtype (the GPU side's projections), else the two ops. One launch fewer; the sum may be
    rounded once where the two ops round twice."""
    if isinstance(lin, Linear) and lin.bias is None and lin.uses_torch(x.shape[0]) and x.dim() == 2 \
            and lin.weight.dtype == x.dtype == residual.dtype and residual.shape == (x.shape[0], lin.weight.shape[0]):
        return torch.addmm(residual, x, lin.weight.t())
    return residual + lin(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm in as few ops as keep its bits (the GPU side's launches): torch's rms_norm normalises in fp32
    and rounds once to x's dtype, which is rms_norm's h.to(dtype); the weight is then applied in that dtype
    as transformers does (fused into the one op in fp32, where there is no rounding between). One launch in
    fp32, two in bf16, against eight."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm kept in fp32, its weight applied in fp32 (llama.cpp's f32 rms_norm and mul): the input of the
    quantized matmuls, which quantize it to Q8_0 from fp32 as llama.cpp does (MoETransformer.fp32_quant_acts)."""
    return F.rms_norm(x.to(torch.float32), (x.shape[-1],), weight.to(torch.float32), eps)  # one fused op


def yarn_factor(cfg: MoEConfig) -> float:
    """The YaRN context scaling factor of cfg.rope_scaling (its own, or max positions / original)."""
    r = cfg.rope_scaling
    return r.get("factor") or cfg.max_position_embeddings / r["original_max_position_embeddings"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context scaled by `scale` (transformers' get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(cfg: MoEConfig) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and attention factor over cfg.rope_dim, as transformers'
    _compute_yarn_parameters computes them (DeepSeek's rope_scaling)."""
    r, base, dim = cfg.rope_scaling, cfg.rope_theta, cfg.rope_dim
    factor, get_mscale = yarn_factor(cfg), yarn_mscale
    orig = r["original_max_position_embeddings"]

    attention_factor = r.get("attention_factor")
    if attention_factor is None:
        if r.get("mscale") and r.get("mscale_all_dim"):
            attention_factor = float(get_mscale(factor, r["mscale"]) / get_mscale(factor, r["mscale_all_dim"]))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = r.get("beta_fast") or 32, r.get("beta_slow") or 1

    def correction_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if r.get("truncate", True) is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extra = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv_freq, attention_factor


def attention_scale(cfg: MoEConfig) -> float:
    """Softmax scale: 1/sqrt(qk head dim), times DeepSeek's YaRN mscale^2 (yarn_apply_mscale)."""
    scale = cfg.qk_head_dim ** -0.5
    r = cfg.rope_scaling
    if r and r.get("mscale_all_dim"):
        m = yarn_mscale(yarn_factor(cfg), r["mscale_all_dim"])
        scale = scale * m * m
    return scale


def rope_tables(cfg: MoEConfig, max_seq: int, dtype: torch.dtype, device):
    """Rotary tables over cfg.rope_dim, computed like transformers (fp32, then cast): cos/sin [max_seq, dim]
    for rotate_half and interleaved styles; for DeepSeek-V2's complex style one complex64 table
    [max_seq, dim/2] (returned as (table, None))."""
    d = cfg.rope_dim
    if cfg.rope_scaling:
        inv_freq, scaling = yarn_inv_freq(cfg)
    else:
        inv_freq, scaling = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0
    freqs = torch.arange(max_seq, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    if cfg.rope_style == "complex":
        return (torch.polar(torch.ones_like(freqs), freqs) * scaling).to(device), None
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x2, x1] of x = [x1, x2] on the last dim: rotate_half without its negation, which signed_sin carries."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sin table with its first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin(sin) bit
    for bit ((-a) * s and a * (-s) are the same IEEE product), one launch fewer per rope."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """apply_rope's "half" style for one tensor (q and k heads together), bit for bit: 4 launches."""
    return x * cos + swap_halves(x) * sin_signed


def rope_half_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """rope_half written back into x (the GPU side's fewest launches: mul, cat, addcmul; addcmul may fuse its
    product and sum, a rounding fewer than rope_half); x may be a view into the projection's output."""
    return torch.addcmul(x * cos, swap_halves(x), sin_signed, out=x)


def apply_rope(cfg: MoEConfig, q: torch.Tensor, k: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, nh, T, d], k [B, nk, T, d]; cos/sin the tables' rows for these positions."""
    if cfg.rope_style == "half":
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    if cfg.rope_style == "interleave":  # DeepSeek-V3: pairs (x0, x1), (x2, x3), ... rotated by one frequency
        c, s_ = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]

        def rot(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)

        return rot(q), rot(k)
    # complex (DeepSeek-V2): the same pairs as complex numbers, in fp32
    def rot(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * cos).flatten(3).type_as(x)

    return rot(q), rot(k)


def route(logits: torch.Tensor, cfg_or_top_k, dtype: torch.dtype, score_bias: torch.Tensor | None = None,
          topk_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: top-k expert ids and weights (in `dtype`) from router logits, as the family's transformers
    router computes them. Mixtral/Qwen/OLMoE: softmax in fp32, top-k, renormalised if norm_topk_prob.
    DeepSeek-V2: softmax, greedy or group-limited top-k (best experts of the best groups), times
    routed_scaling_factor. DeepSeek-V3: sigmoid scores, groups chosen by their top-2 sum with the bias
    correction, experts by biased score, weights the unbiased scores, renormalised and scaled.
    `cfg_or_top_k`: a MoEConfig, or an int top_k for Mixtral's router.

    topk_first (the GPU side's fewest launches): where the top-k weights are a renormalised softmax, the
    softmax of the top-k logits alone, which is the same function in two ops instead of four or more (the
    same experts, as softmax keeps the order; weights within an ulp of fp32). Otherwise, on the CPU with bf16
    weights, the sorted top-k after the scores, its renormalisation and the cast run in one C call wherever
    that gives torch's bits (_topk_in_kernel)."""
    if topk_first and (isinstance(cfg_or_top_k, int) or (  # a renormalised softmax
            cfg_or_top_k.scoring_func == "softmax" and cfg_or_top_k.topk_method == "greedy"
            and cfg_or_top_k.norm_topk_prob and not cfg_or_top_k.router_fp32)):
        K, sort = (cfg_or_top_k, True) if isinstance(cfg_or_top_k, int) else (cfg_or_top_k.top_k, cfg_or_top_k.topk_sorted)
        vals, idx = torch.topk(logits, K, dim=-1, sorted=sort)
        # in the logits' dtype when that is the model's: softmax computes in fp32 and rounds once, as the
        # fp32 softmax and a cast would
        w = torch.softmax(vals, dim=-1) if logits.dtype == dtype else torch.softmax(vals, dim=-1, dtype=torch.float32)
        return idx, w.to(dtype)
    if isinstance(cfg_or_top_k, int):
        probs = torch.softmax(logits.float(), dim=-1)
        fast = _topk_in_kernel(probs, cfg_or_top_k, True, dtype)
        if fast is not None:
            return fast
        w, idx = torch.topk(probs, cfg_or_top_k, dim=-1)
        w /= w.sum(dim=-1, keepdim=True)
        return idx, w.to(dtype)
    cfg = cfg_or_top_k
    E, K, G = cfg.num_experts, cfg.top_k, cfg.n_group
    if cfg.scoring_func == "sigmoid":
        scores = logits.float().sigmoid()
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if cfg.topk_method == "noaux_tc":
        choice = scores + score_bias
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        mask = mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~mask.bool(), float("-inf"))
        idx = torch.topk(choice, k=K, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            w /= w.sum(dim=-1, keepdim=True) + 1e-20
        return idx, (w * cfg.routed_scaling_factor).to(dtype)
    if cfg.topk_method == "group_limited_greedy":
        group_scores = scores.view(-1, G, E // G).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        mask = mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        scores = scores.masked_fill(~mask.bool(), 0.0)
    if cfg.topk_sorted and not cfg.router_fp32:
        fast = _topk_in_kernel(scores, K, cfg.norm_topk_prob, dtype)
        if fast is not None:
            return fast
    w, idx = torch.topk(scores, K, dim=-1, sorted=cfg.topk_sorted)
    if cfg.norm_topk_prob:
        w /= w.sum(dim=-1, keepdim=True)
    if cfg.router_fp32:  # DeepSeek scales (V2: always, whatever the factor)
        w = w * cfg.routed_scaling_factor
    return idx, w.to(dtype)


def _topk_in_kernel(scores: torch.Tensor, K: int, renorm: bool, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """route()'s sorted torch.topk of fp32 CPU scores, its renormalisation (renorm) and the cast to bf16 in
    one C call (fiddler.kernels.route: ~1 us where the four torch ops take ~9 on a small CPU, a decode step
    routing every layer): the same bits, or None where the kernel does not serve them (no library, another
    dtype, a renormalised top-k over 2, ties or NaN among the top k), and torch does."""
    kr = load_route_kernels()
    if kr is None or dtype != torch.bfloat16 or not scores.is_cpu or (renorm and K > 2) or scores.dim() != 2 \
            or not scores.is_contiguous():
        return None
    return kr.topk(scores, K, renorm)


class DenseMLP:
    """A dense layer's SwiGLU MLP (DeepSeek's first_k_dense_replace layers, Qwen's mlp_only_layers): the
    packed expert kernel for bf16 on the CPU, else torch (op for op as transformers' MLP)."""

    def __init__(self, w: ExpertWeights, use_kernel: bool | None):
        k = load_kernels()
        if use_kernel is None:
            use_kernel = w.w1.device.type == "cpu" and w.w1.dtype == torch.bfloat16
        self.packed = k.PackedExpert(w.w1, w.w3, w.w2) if (use_kernel and k is not None) else None
        self.w = None if self.packed is not None else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.forward(x.contiguous())
        return torch_expert(self.w, x)


@dataclass
class DecoderLayer:
    """The non-expert parts of one decoder layer (its experts belong to the executor). GQA layers use
    qkv_proj/o_proj (+ q/k norms); MLA layers `mla` and o_proj. A MoE layer has a router (`moe_index`
    is its executor layer); a dense layer has `mlp` instead."""

    input_norm: torch.Tensor  # RMSNorm weight before attention
    qkv_proj: Linear | None  # fused [q; k; v] projection (GQA)
    o_proj: Linear
    post_norm: torch.Tensor  # RMSNorm weight before the MoE block: its output is the router's input
    router: Linear | None  # the gate: hidden -> one logit per expert (None in a dense layer)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    mla: dict | None = None  # MLA: q_proj | (q_a_proj, q_a_norm, q_b_proj), kv_a_proj, kv_a_norm, kv_b_proj
    router_fp32: torch.Tensor | None = None  # DeepSeek: the router's fp32 weight (router is None then)
    score_bias: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    mlp: DenseMLP | None = None
    moe_index: int | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    on_gpu: bool = False  # on the GPU side (CUDA, or the CPU standing in for it): the ops CUDA runs, no CPU kernels

    def linears(self) -> list[Linear]:
        out = [m for m in (self.qkv_proj, self.o_proj, self.router) if m is not None]
        if self.mla:
            out += [m for m in self.mla.values() if isinstance(m, Linear)]
        return out

    def router_logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.router_fp32 is not None:
            return F.linear(h.float(), self.router_fp32)
        return self.router(h, out=out)


def _block_layer_refusal(l: DecoderLayer, quant: bool) -> str | None:
    """Why layer l is not what the DecodeBlock computes (MoETransformer._block_refusal's per-layer part)."""
    if l.on_gpu or l.mla is not None:
        return "a layer on the GPU side or with MLA"
    if l.mlp is not None:  # a dense layer: no router
        return None
    # a MoE layer's router: the block's bf16 one, or with fp32 activations an fp32 one left to _route
    if quant and (l.router is not None or l.router_fp32 is None):
        return "a router other than the fp32 one of quantized projections"
    if not quant and (l.router is None or l.router_fp32 is not None):
        return "an fp32 router with bf16 activations"
    return None


def segment_groups(segments: Sequence[Segment]) -> list[tuple[int, int, int, int]]:
    """The step's segments as (first cache row, rows, start, tokens per row) groups that attend in one call:
    single tokens at one position on consecutive rows (beams: one SDPA call for all of them, as a GPU
    wants), every other segment alone."""
    out: list[tuple[int, int, int, int]] = []
    for s in segments:
        if out and s.length == 1 and out[-1][3] == 1 and out[-1][2] == s.start and sum(out[-1][:2]) == s.slot:
            out[-1] = (out[-1][0], out[-1][1] + 1, s.start, 1)
        else:
            out.append((s.slot, 1, s.start, s.length))
    return out


class KVCache:
    """Preallocated per-layer caches [batch, heads, max_seq, dim]: keys and values of every KV head (GQA),
    or for MLA the compressed latent (in `k`, one "head" of kv_lora_rank) and the shared rope key (in `v`,
    one head of qk_rope_head_dim), as transformers' DeepSeek caches them. `k`/`v` stack the layers that
    live on `device`; layers placed on the CPU (dense parts that do not fit the GPU) have their own."""

    def __init__(self, cfg: MoEConfig, max_batch: int, max_seq: int, dtype: torch.dtype, device,
                 layer_devices: list[torch.device] | None = None):
        if cfg.attention == "mla":
            kshape, vshape = (1, max_seq, cfg.kv_lora_rank), (1, max_seq, cfg.qk_rope_head_dim)
        else:
            kshape = vshape = (cfg.num_kv_heads, max_seq, cfg.head_dim)
        device = torch.device(device)
        devs = [torch.device(d) for d in layer_devices] if layer_devices else [device] * cfg.num_layers
        main = [i for i, d in enumerate(devs) if d == device]
        other = [i for i, d in enumerate(devs) if d != device]
        if kshape == vshape:  # keys and values side by side: one write puts both (append_kv, the GPU side)
            self.kv = torch.zeros((2, len(main), max_batch, *kshape), dtype=dtype, device=device)
            self.k, self.v = self.kv[0], self.kv[1]
        else:
            self.kv = None
            self.k = torch.zeros((len(main), max_batch, *kshape), dtype=dtype, device=device)
            self.v = torch.zeros((len(main), max_batch, *vshape), dtype=dtype, device=device)
        self._main = set(main)
        self._other = None
        self._where: list[tuple[torch.Tensor, torch.Tensor, int]] = [None] * cfg.num_layers  # type: ignore
        for j, i in enumerate(main):
            self._where[i] = (self.k, self.v, j)
        if other:
            od = devs[other[0]]
            ok = torch.zeros((len(other), max_batch, *kshape), dtype=dtype, device=od)
            ov = torch.zeros((len(other), max_batch, *vshape), dtype=dtype, device=od)
            self._other = (ok, ov)
            for j, i in enumerate(other):
                self._where[i] = (ok, ov, j)
        self.max_batch, self.max_seq = max_batch, max_seq
        self.single = not other  # every layer in self.k / self.v, in layer order

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v, j = self._where[i]
        return k[j], v[j]

    def append(self, i: int, pos: int, k: torch.Tensor, v: torch.Tensor, row: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes layer i's new entries k, v [B, heads, T, dim] at positions pos.. of rows row..row+B-1 and
        returns that layer's filled prefix [B, heads, pos + T, dim] of both. A row is a sequence: a beam, or
        a batch slot (fiddler.batch)."""
        kc, vc = self.layer(i)
        B, T = k.shape[0], k.shape[2]
        kc[row : row + B, :, pos : pos + T] = k
        vc[row : row + B, :, pos : pos + T] = v
        return kc[row : row + B, :, : pos + T], vc[row : row + B, :, : pos + T]

    def joint(self, i: int) -> bool:
        """Whether layer i's keys and values lie side by side (append_kv)."""
        return self.kv is not None and i in self._main

    def append_kv(self, i: int, pos: int, kv: torch.Tensor, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """append() of k = kv[0] and v = kv[1] ([2, B, heads, T, dim], e.g. a view of the fused projection's
        output) in one copy (one launch where append makes two); needs joint(i)."""
        j, B, T = self._where[i][2], kv.shape[1], kv.shape[3]
        self.kv[:, j, row : row + B, :, pos : pos + T] = kv
        return self.k[j, row : row + B, :, : pos + T], self.v[j, row : row + B, :, : pos + T]

    def reorder(self, beam_idx: torch.Tensor, length: int, start: int = 0):
        """Beam search: row b of the cache becomes old row beam_idx[b] on positions [start, length). Only the
        rows that change are copied (beams that continue their own row keep it). The caller passes `start`
        where every row already holds the same entries before it (the prompt and the tokens all beams share),
        so only the positions where beams differ move. A 16-beam, 64-token generation from a 32-token prompt
        on small_mixtral spent 0.52 s of ~12 s in reorders copying whole prefixes, 0.085 s this way (Intel
        Xeon family 6 model 207; index_copy_ of an index_select also beat index assignment by ~20%)."""
        moved = torch.nonzero(beam_idx != torch.arange(beam_idx.shape[0], device=beam_idx.device)).flatten()
        if not moved.numel() or start >= length:
            return
        src = beam_idx[moved]
        for t in (self.k, self.v) + (self._other or ()):
            part = t[:, :, :, start:length]
            # gathered into a new tensor first, so a permutation (row a <- b, b <- a) is safe
            part.index_copy_(1, moved.to(t.device), part.index_select(1, src.to(t.device)))

    def save_row(self, row: int, length: int) -> tuple[torch.Tensor, ...]:
        """A copy of every layer's entries at positions [0, length) of cache row `row` (prefix reuse:
        fiddler.batch.prefix_cache), in the cache's layout and devices."""
        return tuple(t[:, row, :, :length].clone() for t in (self.k, self.v) + (self._other or ()))

    def load_row(self, row: int, saved: tuple[torch.Tensor, ...], length: int) -> None:
        """Writes the first `length` positions of `saved` (from save_row) into cache row `row`."""
        for t, s in zip((self.k, self.v) + (self._other or ()), saved):
            t[:, row, :, :length].copy_(s[:, :, :length])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) + (self._other or ()))


class MoETransformer:
    """The decoder. `forward(tokens, segments)` runs one engine step: it appends each sequence's tokens to
    its KV-cache row and returns logits.

    Decode fast path: for one new token per sequence in bf16 on the CPU with GQA attention, the
    per-token small ops (RMSNorms, rope, KV-cache write, attention) run as single calls into the C++
    kernel library (fiddler.kernels.decode) instead of ~40 torch ops per layer (q/k norms, where the
    family has them, run in torch on the projection's output first). RMSNorm, rope and the cache
    contents are bit-exact with the torch path; attention agrees within one bf16 ulp of each head's output
    magnitude (summation order and exp differ from torch's flash-attention kernel). `decode_fastpath`:
    None = use it where available, False = always the torch ops (reference), True = require it. The
    attribute of the same name can be switched between forward calls (only to False, or back on if it
    was available).

    `layer_devices` (default: every layer on `device`): where each layer's non-expert weights and KV cache
    live; a layer on another device (the CPU, when the dense parts do not fit the GPU) runs there and
    the residual stream moves with it.

    `fp32_quant_acts` (set by fiddler.quant.install_attention for quantized CPU projections): the RMSNorm
    outputs stay fp32 (rms_norm_f32) into the q/k/v projection, an fp32 router and the experts (when the
    executor takes fp32_inputs), like llama.cpp's f32 activations; everything else is unchanged.
    """

    fp32_quant_acts: bool = False
    # fiddler.decode_graph.DecodeGraphs where the decode step's dense part runs as CUDA graphs (Engine's
    # decode_graphs option), else None
    decode_graphs = None
    # torch's intra-op threads for a forward whose linears torch serves (more rows than kernel_max_tokens:
    # a long prefill), where torch does the heavy work; the engine sets its cores here while it keeps
    # torch at one thread for the kernel's sake (fiddler.engine.finalise_linears). None: leave torch's.
    torch_linear_threads: int | None = None
    # fiddler.kernels.attention where a prompt's causal attention (pos 0) runs on the kernel instead of
    # torch's SDPA: chosen by measuring both at load (fiddler.engine.choose_prefill_attention)
    prefill_attention = None

    def __init__(
        self,
        cfg: MoEConfig,
        weights: ModelWeights,
        executor: ExpertExecutor,
        *,
        max_batch: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device,
        use_kernel: bool | None = None,
        decode_fastpath: bool | None = None,
        layer_devices: list[torch.device] | None = None,
        gpu_layers: Sequence[bool] | None = None,
    ):
        self.cfg, self.executor, self.dtype, self.device = cfg, executor, dtype, torch.device(device)
        self.layer_devices = [torch.device(d) for d in layer_devices] if layer_devices else \
            [self.device] * cfg.num_layers
        # Which layers' dense parts are on the GPU side, and whether the embeddings, final norm and lm_head
        # are (gpu_layers given: `device` is a GPU side, CUDA or emulated; else CUDA layers only). The GPU
        # side runs the op sequence CUDA runs, on an emulated GPU too: no CPU kernels, no fused CPU decode.
        self.gpu_layers = [bool(g) for g in gpu_layers] if gpu_layers is not None else \
            [d.type == "cuda" for d in self.layer_devices]
        self.gpu_head = gpu_layers is not None or self.device.type == "cuda"
        self.embed = weights.embed
        self.norm = weights.norm
        self.lm_head = Linear(weights.lm_head, use_kernel=False if self.gpu_head else use_kernel)
        self.layers: list[DecoderLayer] = []
        moe_layers = cfg.moe_layers
        for i, l in enumerate(weights.layers):
            on_gpu = self.gpu_layers[i]
            use_kernel_here = False if on_gpu else use_kernel
            layer = DecoderLayer(input_norm=l.input_norm, qkv_proj=None,
                                 o_proj=Linear(l.o, use_kernel=use_kernel_here, bias=l.o_bias),
                                 post_norm=l.post_norm, router=None, q_norm=l.q_norm, k_norm=l.k_norm,
                                 device=self.layer_devices[i], on_gpu=on_gpu)
            if l.mla is not None:
                layer.mla = {k: (Linear(w, use_kernel=use_kernel_here) if w.dim() == 2 else w)
                             for k, w in l.mla.items()}
            else:
                # q, k and v share their input: one fused [q; k; v] projection is one kernel call (one thread-pool
                # wake-up) instead of three; each output row is the same dot product as before.
                qkv = torch.cat([l.q, l.k, l.v])
                l.q = l.k = l.v = None  # the fused copy replaces them
                layer.qkv_proj = Linear(qkv, use_kernel=use_kernel_here, bias=l.qkv_bias)
            if l.mlp is not None:
                layer.mlp = DenseMLP(l.mlp, use_kernel_here)
            else:
                layer.moe_index = moe_layers.index(i)
                if l.gate.dtype != dtype:  # DeepSeek: an fp32 router
                    layer.router_fp32 = l.gate
                else:
                    layer.router = Linear(l.gate, use_kernel=use_kernel_here)
                layer.score_bias, layer.shared_gate = l.score_bias, l.shared_gate
            self.layers.append(layer)
        self.cache = KVCache(cfg, max_batch, max_seq_len, dtype, self.device, self.layer_devices)
        self.cos, self.sin = rope_tables(cfg, max_seq_len, dtype, self.device)
        self._rope_on: dict[torch.device, tuple] = {self.device: (self.cos, self.sin)}
        self._sin_signed: dict[torch.device, torch.Tensor] = {}
        self.scale = attention_scale(cfg)
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self._bufs: dict[tuple, torch.Tensor] = {}  # decode-step result buffers, reused every step
        self._kernel_norm = None  # fiddler.kernels.decode.rms_norm where the decode kernels are bound
        self._kernel_norm_f32 = None  # and its rms_norm_f32
        self._decode_ops, why = self._make_decode_ops(use_kernel)
        self._decode_ops_error = why
        # the fused step's layers in one call each where they qualify (_decode_block); False: separate calls
        self.decode_blocks = True
        self._block, self._block_max_tokens, self._block_why = None, 0, None
        if decode_fastpath and self._decode_ops is None:
            raise ValueError(f"decode_fastpath=True but the fused decode kernels cannot be used: {why}")
        self.decode_fastpath = self._decode_ops is not None and decode_fastpath is not False
        # Distinct experts used per layer in decode steps with several rows (beams share experts), for
        # the decode bound (a tensor on the experts' device once counted; read once per generate); with one
        # row it is top_k (+ shared slots) and is not counted.
        self.multi_row_expert_loads = 0
        self.multi_row_layer_steps = 0
        self.last_path: str | None = None  # the path the last forward took (fiddler.step.PATHS)

    def _make_decode_ops(self, use_kernel: bool | None):
        """(fiddler.kernels.decode.DecodeAttention bound to this model's cache, None) or (None, why not)."""
        if self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return None, f"needs bf16 on the CPU (model is {self.dtype} on {self.device})"
        if use_kernel is False:
            return None, "use_kernel=False"
        if self.gpu_head or any(self.gpu_layers):
            return None, "the dense part is on the (emulated) GPU side, which runs the ops CUDA runs"
        if self.cfg.attention != "gqa" or self.cfg.rope_style != "half" or self.cfg.rope_scaling:
            return None, f"the fused attention implements GQA with default rope, not {self.cfg.attention}"
        if not self.cache.single:
            return None, "layers on several devices"
        kd = load_decode_kernels()
        if kd is None:
            return None, decode_kernels_error()
        norms = [self.norm] + [w for layer in self.layers for w in (layer.input_norm, layer.post_norm)]
        if any(w.dtype != torch.bfloat16 or w.dim() != 1 or not w.is_contiguous() for w in norms):
            return None, "norm weights are not contiguous 1-D bf16"
        try:
            ops = kd.DecodeAttention(self.cache.k, self.cache.v, self.cos, self.sin, num_heads=self.cfg.num_heads,
                                     sliding_window=self.cfg.sliding_window)
        except (TypeError, ValueError) as e:
            return None, str(e)
        self._kernel_norm, self._kernel_norm_f32 = kd.rms_norm, kd.rms_norm_f32
        return ops, None

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        return fused_rms_norm(x, self.norm, eps) if self.gpu_head else self._norm(x, self.norm, eps)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm, by the C++ kernel where the decode kernels are bound (bit-exact with rms_norm, and at a
        prompt's thousands of rows about 17x faster than torch's fp32 temporaries, which leave the caches:
        2.2 against 38 ms at 4096 x 2048, Intel Xeon family 6 model 207), else in torch."""
        if self._kernel_norm is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16 and \
                x.is_contiguous() and weight.device.type == "cpu":
            return self._kernel_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def _norm_f32(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm_f32 (the quantized projections' fp32 input), by the C++ kernel where the decode kernels are
        bound and x is bf16 on the CPU (bit-exact with it: one call for torch's four ops), else in torch."""
        if self._kernel_norm_f32 is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16 and \
                x.is_contiguous() and weight.device.type == "cpu" and weight.dtype == torch.float32:
            return self._kernel_norm_f32(x, weight, eps)
        return rms_norm_f32(x, weight, eps)

    def _buf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor | None:
        """A reusable output buffer for decode steps (one token per row); None for prefill, whose shapes vary."""
        if shape[0] > self.max_batch:
            return None
        device = torch.device(device) if device is not None else self.device
        key = (name, shape, dtype, device)
        b = self._bufs.get(key)
        if b is None:
            b = self._bufs[key] = torch.empty(shape, dtype=dtype, device=device)
        return b

    def _rope(self, device: torch.device):
        if device not in self._rope_on:
            self._rope_on[device] = tuple(t.to(device) if t is not None else None for t in (self.cos, self.sin))
        return self._rope_on[device]

    def _signed_sin(self, device: torch.device) -> torch.Tensor:
        if device not in self._sin_signed:
            self._sin_signed[device] = signed_sin(self._rope(device)[1])
        return self._sin_signed[device]

    def linears(self) -> list[Linear]:
        return [self.lm_head] + [m for layer in self.layers for m in layer.linears()]

    def set_kernel_max_tokens(self, n: int):
        self._block = None  # rebound with the new crossover (_decode_block)
        for lin in self.linears():
            lin.kernel_max_tokens = n
            if lin.packed is not None and n >= Linear.kernel_max_tokens:
                lin.weight = None  # the kernel serves every token count: drop torch's copy of the weight

    # ------------------------------------------------------------------ attention

    def _qk_norm_clip(self, layer: DecoderLayer, qkv: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """Qwen3's per-head and OLMoE's full-width q/k RMSNorms and OLMoE's clip_qkv, applied to the fused
        projection's output [B*T, (nh + 2 nkv) d] (in place) before rope."""
        cfg = self.cfg
        nq, nk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if cfg.qk_norm == "head":
            d = cfg.head_dim
            qkv[:, :nq] = rms_norm(qkv[:, :nq].reshape(-1, cfg.num_heads, d), layer.q_norm,
                                   cfg.rms_norm_eps).reshape(-1, nq)
            qkv[:, nq:nq + nk] = rms_norm(qkv[:, nq:nq + nk].reshape(-1, cfg.num_kv_heads, d), layer.k_norm,
                                          cfg.rms_norm_eps).reshape(-1, nk)
        elif cfg.qk_norm == "full":
            qkv[:, :nq] = rms_norm(qkv[:, :nq], layer.q_norm, cfg.rms_norm_eps)
            qkv[:, nq:nq + nk] = rms_norm(qkv[:, nq:nq + nk], layer.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            qkv.clamp_(min=-cfg.clip_qkv, max=cfg.clip_qkv)
        return qkv

    def _sdpa(self, q, keys, values, B: int, T: int, pos: int, nkv: int, on_gpu: bool = False) -> torch.Tensor:
        """Causal attention of T queries at pos.. over keys [0, pos + T) (and the sliding window);
        returns [B*T, nh * dv]."""
        nh, L, window, scale = q.shape[1], pos + T, self.cfg.sliding_window, self.scale
        d = q.shape[-1]
        if T == 1 and (window is None or L <= window):
            # One query per sequence: attend per KV head with its group of query heads (no repeat of K/V).
            o = F.scaled_dot_product_attention(q.reshape(B, nkv, nh // nkv, d), keys, values, scale=scale)
        elif pos == 0 and (window is None or L <= window):
            ka = None if on_gpu else self.prefill_attention
            if ka is not None and ka.supports(q, keys, values):
                return ka.causal_attention(q, keys, values, scale)  # already [B*T, nh * dv]
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=nh != nkv)
        else:
            qi = torch.arange(pos, L, device=q.device)[:, None]
            kj = torch.arange(L, device=q.device)[None, :]
            mask = kj <= qi
            if window is not None:
                mask &= kj > qi - window
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=nh != nkv)
        return o.reshape(B, nh, T, -1).transpose(1, 2).reshape(B * T, -1)

    def _gqa_qkv(self, i: int, h: torch.Tensor, qkv_proj) -> torch.Tensor:
        """The fused q/k/v projection of rows h [N, H] (+ q/k norms, clip): [N, (nh + 2 nkv) d]."""
        cfg, layer = self.cfg, self.layers[i]
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        main = h.device == self.device
        qkv = qkv_proj(h, out=self._buf("qkv", (h.shape[0], (nh + 2 * nkv) * d), self.dtype) if main else None)
        if cfg.qk_norm or cfg.clip_qkv is not None:
            qkv = self._qk_norm_clip(layer, qkv, 1, h.shape[0])
        return qkv

    def _gqa_core(self, i: int, qkv: torch.Tensor, B: int, T: int, pos: int, row: int = 0) -> torch.Tensor:
        """Rope, KV-cache append (cache rows row..row+B-1) and attention of the projected qkv [B*T, width]
        at positions pos..pos+T-1: [B*T, nh * d], the input of o_proj."""
        cfg = self.cfg
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = qkv.view(B, T, nh + 2 * nkv, d)
        q = qkv[:, :, :nh].transpose(1, 2)
        k = qkv[:, :, nh : nh + nkv].transpose(1, 2)
        v = qkv[:, :, nh + nkv :].transpose(1, 2)
        cos, sin = self._rope(qkv.device)
        if self.layers[i].on_gpu and cfg.rope_style == "half" and self.cache.joint(i):
            # The GPU side's fewest launches: rope of the q and k heads written back into the projection's
            # output, then k and v, now side by side there, into the cache in one copy.
            rope_half_(qkv[:, :, : nh + nkv].transpose(1, 2), cos[pos : pos + T],
                       self._signed_sin(qkv.device)[pos : pos + T])
            kv = qkv[:, :, nh:].view(B, T, 2, nkv, d).permute(2, 0, 3, 1, 4)
            keys, values = self.cache.append_kv(i, pos, kv, row)
            return self._sdpa(q, keys, values, B, T, pos, nkv, True)
        if cfg.rope_style == "half":  # q and k heads in one chain (the same products and sums as apply_rope)
            qk = rope_half(qkv[:, :, : nh + nkv].transpose(1, 2), cos[pos : pos + T],
                           self._signed_sin(qkv.device)[pos : pos + T])
            q, k = qk[:, :nh], qk[:, nh:]
        else:
            q, k = apply_rope(cfg, q, k, cos[pos : pos + T], sin[pos : pos + T])
        keys, values = self.cache.append(i, pos, k, v, row)
        return self._sdpa(q, keys, values, B, T, pos, nkv, self.layers[i].on_gpu)

    def _mla_attention(self, i: int, h: torch.Tensor, B: int, T: int, pos: int, row: int = 0):
        """DeepSeek's multi-head latent attention of layer i, op for op as transformers' DeepseekV2/V3
        Attention: queries through the optional low-rank q_a/q_b pair, keys and values from the cached
        compressed latent (RMSNorm'd) expanded by kv_b_proj every step, plus the one shared rope key."""
        cfg, m = self.cfg, self.layers[i].mla
        nh, dn, dr, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if "q_proj" in m:
            q = m["q_proj"](h)
        else:  # transformers' DeepseekV2RMSNorm default eps (1e-6) for the low-rank norms, not rms_norm_eps
            q = m["q_b_proj"](rms_norm(m["q_a_proj"](h), m["q_a_norm"], 1e-6))
        q = q.view(B, T, nh, dn + dr).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [dn, dr], dim=-1)
        kv_nope, k_pe = torch.split(m["kv_a_proj"](h), [r, dr], dim=-1)
        latent = rms_norm(kv_nope, m["kv_a_norm"], 1e-6).view(B, 1, T, r)
        k_pe = k_pe.reshape(B, 1, T, dr)
        cos, sin = self._rope(h.device)
        if cfg.rope_style == "complex":
            q_pe, k_pe = apply_rope(cfg, q_pe, k_pe, cos[pos : pos + T], None)
        else:
            q_pe, k_pe = apply_rope(cfg, q_pe, k_pe, cos[pos : pos + T], sin[pos : pos + T])
        lc, pc = self.cache.append(i, pos, latent, k_pe, row)  # the latents and rope keys so far
        L = pos + T
        kv = m["kv_b_proj"](lc[:, 0].reshape(B * L, r)).view(B, L, nh, dn + dv).transpose(1, 2)
        k_nope, values = torch.split(kv, [dn, dv], dim=-1)
        keys = kv.new_empty(B, nh, L, dn + dr)
        keys[..., :dn].copy_(k_nope)
        keys[..., dn:].copy_(pc.expand(-1, nh, -1, -1))
        query = torch.cat((q_nope, q_pe), dim=-1)
        o = self._sdpa(query, keys, values, B, T, pos, nh, self.layers[i].on_gpu)
        return self.layers[i].o_proj(o)

    def _attend(self, i: int, h: torch.Tensor, groups: list[tuple[int, int, int, int]],
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of layer i for the flat rows h [N, H] of a step's sequences (segment_groups: first cache
        row, rows, start, tokens per row, in row order): the projections run once on all rows, rope / cache /
        attention per group with its own cache rows and positions. With `residual`: residual + attention
        (the GPU side's o_proj adds it in its GEMM, linear_add)."""
        layer = self.layers[i]
        outs, r = [], 0
        if layer.mla is not None:
            for row, B, start, T in groups:
                outs.append(self._mla_attention(i, h[r : r + B * T], B, T, start, row))
                r += B * T
            o = torch.cat(outs) if len(outs) > 1 else outs[0]
            return o if residual is None else residual + o
        qkv = self._gqa_qkv(i, h, layer.qkv_proj)
        for row, B, start, T in groups:
            outs.append(self._gqa_core(i, qkv[r : r + B * T], B, T, start, row))
            r += B * T
        o = torch.cat(outs) if len(outs) > 1 else outs[0]
        if residual is not None:
            return linear_add(layer.o_proj, o, residual)
        main = h.device == self.device
        return layer.o_proj(o, out=self._buf("o", (h.shape[0], self.cfg.hidden_size), self.dtype) if main else None)

    # ------------------------------------------------------------------ MLP / MoE

    def _route(self, layer: DecoderLayer, h: torch.Tensor, buffered: bool = True, logits: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids and weights [T, active_slots] for the executor: the router's top-k, then every shared
        slot (weight sigmoid(x . w_gate) for Qwen2-MoE's gated shared expert, else 1). buffered: decode
        logits into a reused buffer (not inside a CUDA graph, whose outputs are its own). `logits`: the
        router's output for h where already computed (the fused decode block's)."""
        cfg = self.cfg
        if logits is None:
            main = h.device == self.device and buffered
            logits = layer.router_logits(h, out=self._buf("router", (h.shape[0], cfg.num_experts), h.dtype)
                                         if main and layer.router is not None else None)
        idx, w = route(logits, cfg, self.dtype, layer.score_bias, topk_first=layer.on_gpu)
        S = cfg.shared_slots
        if S:
            T = h.shape[0]
            ids = torch.arange(cfg.num_experts, cfg.num_experts + S, device=idx.device).expand(T, S)
            g = torch.sigmoid(F.linear(h.to(layer.shared_gate.dtype), layer.shared_gate)) if layer.shared_gate is not None else \
                torch.ones(T, 1, dtype=w.dtype, device=w.device)
            idx = torch.cat([idx, ids], dim=1)
            w = torch.cat([w, g.to(w.dtype).expand(T, S)], dim=1)
        return idx, w

    def _moe(self, i: int, x: torch.Tensor, h: torch.Tensor, count_rows: bool, logits: torch.Tensor | None = None
             ) -> torch.Tensor:
        """x + MLP(h) for layer i: a dense layer's MLP, or route, hand the experts to the executor, then the
        executor's hook that sees the residual stream after each MoE layer (e.g. to guess and prefetch the
        next layer's experts with its router, as Mixtral-Offloading does)."""
        layer = self.layers[i]
        if layer.mlp is not None:
            return x + layer.mlp(h.to(self.dtype))
        idx, w = self._route(layer, h, logits=logits)
        return self._experts(i, x, h, idx, w, count_rows)

    def _experts(self, i: int, x: torch.Tensor, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                 count_rows: bool) -> torch.Tensor:
        """x + the experts' output for MoE layer i, routed (idx, w): the executor's call and its hook."""
        layer = self.layers[i]
        if h.dtype != self.dtype and not self.executor.fp32_inputs:
            h = h.to(self.dtype)
        if count_rows:  # decode with several rows (beams): distinct experts per layer, for the decode bound
            # marked in a device tensor and summed there: no host sync (bincount would size its output on the host)
            seen = torch.zeros(self.cfg.expert_slots, dtype=torch.int32, device=idx.device)
            seen[idx.flatten()] = 1
            self.multi_row_expert_loads = seen.sum() + self.multi_row_expert_loads
            self.multi_row_layer_steps += 1
        j = layer.moe_index
        if h.device != self.device:  # a layer whose dense part lives on the CPU: experts see the GPU side
            x = x + self.executor.forward(j, h.to(self.device), idx.to(self.device), w.to(self.device)).to(h.device)
        else:
            x = self.executor.forward(j, h, idx, w, residual=x)
        self.executor.after_moe(j, x)
        return x

    def _decode_step(self, tokens: torch.Tensor, groups: list[tuple[int, int, int, int]], all_logits: bool
                     ) -> torch.Tensor:
        """The step when every sequence adds one token, with the fused kernels (see the class docstring); same
        results contract. Rows 0..B-1 at one position (a request, or its beams) take the kernel's one-position
        call, others (continuous batching) its per-row call: the same bits per row either way."""
        cfg, eps, dt = self.cfg, self.cfg.rms_norm_eps, self.dtype
        B, H = tokens.shape[0], cfg.hidden_size
        norm, attend = self._kernel_norm, self._decode_ops
        if attend.k_cache is not self.cache.k or attend.v_cache is not self.cache.v:
            raise RuntimeError("the KV cache was replaced after the decode kernels were bound to it")
        if len(groups) == 1 and groups[0][0] == 0:
            pos, rows = groups[0][2], None
        else:
            pos = torch.tensor([g[2] for g in groups for _ in range(g[1])], dtype=torch.int64)
            rows = torch.tensor([g[0] + b for g in groups for b in range(g[1])], dtype=torch.int64)
        qk_ops = cfg.qk_norm is not None or cfg.clip_qkv is not None
        x = F.embedding(tokens, self.embed)  # [B, H]
        f32 = self.fp32_quant_acts
        block = self._decode_block(B)
        if block is not None:  # every layer's seven small calls in one (fiddler.kernels.decode.DecodeBlock)
            pos_b = (ctypes.c_int64 * B)(*([pos] * B if rows is None else pos.tolist()))
            rows_b = (ctypes.c_int64 * B)(*(range(B) if rows is None else rows.tolist()))
            threads = self.layers[0].qkv_proj.packed_threads()
            x = self._layers(x, None, None, B > 1,
                             block=lambda i, x: block(i, x.contiguous(), pos_b, rows_b, threads))
        else:
            x = self._layer_ops(x, B, pos, rows, qk_ops, f32)
        xn = norm(x, self.norm, eps, out=self._buf("norm_f", (B, H), dt))
        # Note: decode logits live in a reused buffer, valid until the next forward call.
        head = self.lm_head
        out = None if all_logits else self._buf("logits", (B, cfg.vocab_size), torch.float32)
        if not head.uses_torch(B):  # a small head on the calling thread (small_call_threads)
            return head.packed.forward(xn, out=out, out_dtype=torch.float32,
                                       threads=small_call_threads(head.packed.nbytes, head.threads))
        return head(xn, out_dtype=torch.float32, out=out)

    def _layer_ops(self, x: torch.Tensor, B: int, pos, rows, qk_ops: bool, f32: bool) -> torch.Tensor:
        """The fused decode step's layers as separate calls (each kernel alone, torch between them): where a
        layer is not what the DecodeBlock computes (see _decode_block)."""
        cfg, eps, dt, H = self.cfg, self.cfg.rms_norm_eps, self.dtype, self.cfg.hidden_size
        norm, attend = self._kernel_norm, self._decode_ops
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        buf_n1, buf_n2 = self._buf("norm1", (B, H), dt), self._buf("norm2", (B, H), dt)
        buf_qkv = self._buf("qkv", (B, (nh + 2 * nkv) * d), dt)
        buf_att, buf_o = self._buf("attn", (B, nh * d), dt), self._buf("o", (B, H), dt)

        def fused_attention(i: int, h: torch.Tensor) -> torch.Tensor:
            layer = self.layers[i]
            qkv = layer.qkv_proj(h, out=buf_qkv)
            if qk_ops:
                qkv = self._qk_norm_clip(layer, qkv, B, 1)
            a = attend(i, qkv, pos, buf_att) if rows is None else attend.rows(i, qkv, pos, rows, buf_att)
            return layer.o_proj(a, out=buf_o)

        def fused_norm(x: torch.Tensor, w: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
            return self._norm_f32(x, w, eps) if f32 else norm(x, w, eps, out=buf)

        return self._layers(x, fused_attention, fused_norm, B > 1, (buf_n1, buf_n2))

    def _decode_block(self, B: int):
        """The one rule for the fused decode step's one-call layers: fiddler.kernels.decode.DecodeBlock bound to
        the layers as they are now, or None where any layer is not the GQA layer it computes (OLMoE's
        full-width q/k norms or clip, a DeepSeek fp32 router, the GPU side, more rows than the projections' kernel serves; see
        `_block_refusal`): the plain bf16 MoE layer, or with quantized projections and their fp32 activations
        (fp32_quant_acts: the fp32 router left to _route); a dense MLP layer takes the block without router
        logits. Bound on first use, and again when a projection was replaced (fiddler.quant installs its own
        after the model is built) or the projections' crossover changed (set_kernel_max_tokens)."""
        if not self.decode_blocks:
            return None
        key = [(l.qkv_proj, l.o_proj, l.router) for l in self.layers]
        if self._block is None or self._block[0] != key:
            self._block = (key, self._bind_block(key))
        block = self._block[1]
        return block if block is not None and B <= self._block_max_tokens else None

    def _block_refusal(self, key) -> str | None:
        """Why the layers are not what the DecodeBlock computes (None: they are)."""
        cfg, quant = self.cfg, self.fp32_quant_acts
        if cfg.qk_norm not in (None, "head") or cfg.clip_qkv is not None:  # Qwen3's per-head norms it computes
            return "full-width q/k norms or clip_qkv"
        if self._decode_ops is None:
            return "no fused decode ops"
        lins = [lin for trio in key for lin in trio if lin is not None]
        if any(getattr(lin, "packed", None) is None or (not quant and not isinstance(lin, Linear)) for lin in lins):
            return "a projection outside the CPU kernel"
        if len({lin.threads for lin in lins}) != 1:
            return "projections with different thread counts"
        return next((why for why in (_block_layer_refusal(l, quant) for l in self.layers) if why), None)

    def _bind_block(self, key):
        self._block_why = self._block_refusal(key)
        if self._block_why is not None:
            return None
        self._block_max_tokens = min(lin.kernel_max_tokens for trio in key for lin in trio if lin is not None)
        try:
            return load_decode_kernels().DecodeBlock(
                self._decode_ops, [(l.input_norm, l.post_norm, q.packed, o.packed, r and r.packed, l.q_norm, l.k_norm)
                                   for l, (q, o, r) in zip(self.layers, key)], self.cfg.rms_norm_eps)
        except (TypeError, ValueError) as e:  # the binding's own checks: said in decode_path(), never silent
            self._block_why = str(e)
            return None

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], *, all_logits: bool = False
                ) -> torch.Tensor:
        """The one forward: every sequence of an engine step at once. `tokens` [N] holds the segments' tokens
        back to back; segment s (fiddler.step.Segment) appends its `length` tokens at positions start.. of
        KV-cache row `slot`. The router and the experts see all N tokens (the executor plans each layer once
        for the whole step). Returns fp32 logits [n, V] of the last token of each segment with `logits` set,
        in order (all_logits: [N, V], every position). Decode logits may live in a reused buffer, valid
        until the next forward. `last_path` says which path ran (fiddler.step.PATHS)."""
        N = self._check_segments(tokens, segments)
        groups = segment_groups(segments)
        with torch_threads(self.torch_linear_threads if self._torch_serves_linears(N) else None):
            if N == len(segments) and self.decode_graphs is not None and self.decode_graphs.serves(segments):
                self.last_path = "graph_decode"
                return self.decode_graphs.step(tokens, segments)
            if N == len(segments) and self._fused_decode(tokens.device):
                self.last_path = "fused_decode"
                logits = self._decode_step(tokens, groups, all_logits)
                if all_logits or all(s.logits for s in segments):
                    return logits
                return logits[torch.tensor([s.logits for s in segments])]
            self.last_path = "general"
            return self._forward(tokens, segments, groups, all_logits)

    def decode_path(self) -> dict:
        """The path a decode step takes here (fiddler.step.PATHS), and why where it is not the fused one."""
        if self.decode_graphs is not None:  # rows 0..B-1; other decode steps take the general path
            return {"path": "graph_decode", "captured": self.decode_graphs.capture}
        if self._fused_decode(self.device):
            if self.decode_blocks and self._decode_block(1) is None:  # each layer's calls one by one, and why
                why = self._block_why or "the projections' kernel serves no single-row call"
                return {"path": "fused_decode", "layers": "separate calls", "why": why}
            return {"path": "fused_decode"}
        why = "decode_fastpath is off" if self._decode_ops is not None else self._decode_ops_error
        return {"path": "general", "why": why or f"the model's device is {self.device.type}"}

    def _check_segments(self, tokens: torch.Tensor, segments: Sequence[Segment]) -> int:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D (the segments' tokens back to back), got shape {tuple(tokens.shape)}")
        N = tokens.shape[0]
        if not segments or sum(s.length for s in segments) != N:
            raise ValueError(f"segments cover {sum(s.length for s in segments)} tokens, got {N}")
        for s in segments:
            if not 0 <= s.slot < self.max_batch:
                raise ValueError(f"cache row {s.slot} outside the KV cache's rows [0, max_batch={self.max_batch})")
            if s.length < 1 or s.start < 0:
                raise ValueError(f"segment of {s.length} tokens at position {s.start}")
            if s.start + s.length > self.max_seq_len:
                raise ValueError(f"sequence length {s.start + s.length} exceeds the KV cache size "
                                 f"max_seq_len={self.max_seq_len}")
        if len({s.slot for s in segments}) != len(segments):
            raise ValueError("two segments on the same cache row")
        return N

    def _fused_decode(self, device: torch.device) -> bool:
        """The one rule for the fused CPU decode step (its caller: every sequence adds one token): the kernels
        bound (bf16, CPU, GQA, one device: see _make_decode_ops) and not switched off (decode_fastpath)."""
        return self.decode_fastpath and self._decode_ops is not None and device.type == "cpu"

    def _layers(self, x: torch.Tensor, attention, norm, count_rows: bool, bufs=(None, None), block=None
                ) -> torch.Tensor:
        """The one layer loop every forward runs: x + attention(norm(x)), then x + MoE/MLP(norm(x)), layer by
        layer, the residual stream following each layer's device. attention(i, h) and norm(x, weight, buf)
        are the step's (on the GPU side attention(i, h, x) returns x + attention, added in o_proj's GEMM) (the fused decode kernels' into reused buffers, or the general ops); count_rows: count
        the distinct experts of a several-row decode step (the decode bound). block(i, x) -> (x + attention,
        the post-attention norm's output, router logits): the fused decode step's one call a layer
        (fiddler.kernels.decode.DecodeBlock), in place of attention and both norms."""
        eps = self.cfg.rms_norm_eps
        for i, layer in enumerate(self.layers):
            if block is not None:
                x, h, logits = block(i, x)
                x = self._moe(i, x, h, count_rows, logits)
                continue
            if x.device != layer.device:
                x = x.to(layer.device)
            if layer.on_gpu:  # the fewest launches: one per norm (fused_rms_norm), residuals added in GEMMs
                x = attention(i, fused_rms_norm(x, layer.input_norm, eps), x)
                x = self._moe(i, x, fused_rms_norm(x, layer.post_norm, eps), count_rows)
                continue
            x = x + attention(i, norm(x, layer.input_norm, bufs[0]))
            x = self._moe(i, x, norm(x, layer.post_norm, bufs[1]), count_rows)
        return x

    def _torch_serves_linears(self, rows: int) -> bool:
        """Whether torch serves the projections the packed kernel serves at fewer rows (every Linear has the
        same kernel_max_tokens; layers on a GPU always use torch, quantized projections their kernel)."""
        lin = next((l.o_proj for l in self.layers if isinstance(l.o_proj, Linear) and l.o_proj.packed is not None),
                   None)
        return lin is not None and lin.uses_torch(rows)

    def _forward(self, tokens: torch.Tensor, segments: Sequence[Segment], groups, all_logits: bool) -> torch.Tensor:
        """The general path: the ops every device and dtype runs (prefill, chunks, fp32, a GPU side)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        norm = self._norm_f32 if self.fp32_quant_acts else self._norm  # final norm: bf16 into the bf16 lm_head
        x = F.embedding(tokens.to(self.embed.device), self.embed)  # [N, H]
        decode_rows = len(segments) if len(segments) == tokens.shape[0] else 0
        x = self._layers(x, lambda i, h, residual=None: self._attend(i, h, groups, residual),
                         lambda x, w, _buf: norm(x, w, eps),
                         decode_rows > 1)
        x = x.to(self.norm.device)
        if all_logits:
            return self.lm_head(self._final_norm(x), out_dtype=torch.float32)
        if not decode_rows:
            ends = torch.tensor([s.length for s in segments]).cumsum(0) - 1
            x = x[ends[torch.tensor([s.logits for s in segments])].to(x.device)]
        elif not all(s.logits for s in segments):
            x = x[torch.tensor([s.logits for s in segments], device=x.device)]
        # Note: decode logits live in a reused buffer, valid until the next forward call.
        return self.lm_head(self._final_norm(x), out_dtype=torch.float32,
                            out=self._buf("logits", (x.shape[0], cfg.vocab_size), torch.float32))
