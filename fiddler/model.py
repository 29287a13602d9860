"""The Mixtral forward pass in plain PyTorch.

Op order and dtypes follow transformers' modeling_mixtral.py (5.24) so that fp32 results agree to
rounding and bf16 results to bf16 noise: RMSNorm in fp32 then cast back, rope tables built in fp32
and cast to the model dtype, router softmax in fp32, top-k renormalised. Expert FFNs are not computed
here: the MoE block hands (tokens, top-k ids, top-k weights) to an executor (fiddler.executors), which
decides where each expert runs (the Fiddler part).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import MoEConfig
from .executors.contract import ExpertExecutor
from .kernel_loader import decode_kernels_error, load_decode_kernels, load_kernels
from .weights import ModelWeights


class Linear:
    """y = x @ w.T. On the CPU in bf16 it uses the packed AVX512-BF16 kernel (torch's bf16 GEMV is far from
    the memory limit); otherwise, and for token counts above `kernel_max_tokens` where oneDNN/AMX matmul
    may win (decided by measurement, see `choose_kernel_max_tokens`), torch. `weight` is None once the
    kernel serves every token count (the engine drops torch's copy)."""

    kernel_max_tokens: int = 1 << 30  # default; the Engine sets it per model from a measurement

    def __init__(self, weight: torch.Tensor, *, use_kernel: bool | None = None):
        self.weight: torch.Tensor | None = weight
        k = load_kernels()
        if use_kernel is None:
            use_kernel = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        self.packed = k.PackedLinear(weight) if (use_kernel and k is not None) else None
        self.threads: int | None = None

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out` (kernel path only): a preallocated [tokens, out_features] result buffer to write into."""
        if self.packed is not None and x.shape[0] <= self.kernel_max_tokens:
            return self.packed.forward(x, out=out, threads=self.threads, out_dtype=out_dtype or x.dtype)
        y = F.linear(x, self.weight)
        return y if out_dtype is None else y.to(out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_tables(cfg: MoEConfig, max_seq: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seq, head_dim], computed exactly like transformers' default rope (fp32, then cast)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = torch.arange(max_seq, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def route(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral router: softmax in fp32 over all experts, top-k, renormalise over the chosen ones."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    w /= w.sum(dim=-1, keepdim=True)
    return idx, w.to(dtype)


@dataclass
class DecoderLayer:
    """The non-expert parts of one decoder layer (its experts belong to the executor)."""

    input_norm: torch.Tensor  # RMSNorm weight before attention
    qkv_proj: Linear  # fused [q; k; v] projection
    o_proj: Linear
    post_norm: torch.Tensor  # RMSNorm weight before the MoE block: its output is the router's input
    router: Linear  # the gate: hidden -> one logit per expert

    def linears(self) -> list[Linear]:
        return [self.qkv_proj, self.o_proj, self.router]


class KVCache:
    """Preallocated [batch, kv_heads, max_seq, head_dim] keys and values per layer."""

    def __init__(self, cfg: MoEConfig, max_batch: int, max_seq: int, dtype: torch.dtype, device):
        shape = (cfg.num_layers, max_batch, cfg.num_kv_heads, max_seq, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_batch, self.max_seq = max_batch, max_seq

    def reorder(self, beam_idx: torch.Tensor, length: int):
        """Beam search: row b of the cache becomes old row beam_idx[b] (only the filled prefix is copied)."""
        B = beam_idx.shape[0]
        for t in (self.k, self.v):
            t[:, :B, :, :length] = t[:, :B, :, :length].index_select(1, beam_idx)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class MoETransformer:
    """Mixtral decoder. `forward(tokens[B, T], start_pos)` appends to the KV cache and returns logits.

    Decode fast path: for one new token per row (T == 1) in bf16 on the CPU, the per-token small ops
    (RMSNorms, rope, KV-cache write, attention) run as single calls into the C++ kernel library
    (fiddler.kernels.decode) instead of ~40 torch ops per layer. RMSNorm, rope and the cache contents are
    bit-exact with the torch path; attention agrees within one bf16 ulp of each head's output magnitude
    (summation order and exp differ from torch's flash-attention kernel). `decode_fastpath`: None = use it
    where available, False = always the torch ops (reference), True = require it. The attribute of the
    same name can be switched between forward calls (only to False, or back on if it was available).
    """

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
    ):
        self.cfg, self.executor, self.dtype, self.device = cfg, executor, dtype, torch.device(device)
        self.embed = weights.embed
        self.norm = weights.norm
        self.lm_head = Linear(weights.lm_head, use_kernel=use_kernel)
        # q, k and v share their input: one fused [q; k; v] projection is one kernel call (one thread-pool
        # wake-up) instead of three; each output row is the same dot product as before.
        self.layers: list[DecoderLayer] = []
        for l in weights.layers:
            qkv = torch.cat([l.q, l.k, l.v])
            l.q = l.k = l.v = None  # the fused copy replaces them
            self.layers.append(DecoderLayer(
                input_norm=l.input_norm,
                qkv_proj=Linear(qkv, use_kernel=use_kernel),
                o_proj=Linear(l.o, use_kernel=use_kernel),
                post_norm=l.post_norm,
                router=Linear(l.gate, use_kernel=use_kernel),
            ))
        self.cache = KVCache(cfg, max_batch, max_seq_len, dtype, self.device)
        self.cos, self.sin = rope_tables(cfg, max_seq_len, dtype, self.device)
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self._bufs: dict[tuple, torch.Tensor] = {}  # decode-step result buffers, reused every step
        self._decode_norm = None
        self._decode_ops, why = self._make_decode_ops(use_kernel)
        if decode_fastpath and self._decode_ops is None:
            raise ValueError(f"decode_fastpath=True but the fused decode kernels cannot be used: {why}")
        self.decode_fastpath = self._decode_ops is not None and decode_fastpath is not False
        # Distinct experts used per layer in decode steps with several rows (beams share experts), for
        # the decode bound; with one row it is top_k and is not counted.
        self.multi_row_expert_loads = 0
        self.multi_row_layer_steps = 0

    def _make_decode_ops(self, use_kernel: bool | None):
        """(fiddler.kernels.decode.DecodeAttention bound to this model's cache, None) or (None, why not)."""
        if self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return None, f"needs bf16 on the CPU (model is {self.dtype} on {self.device})"
        if use_kernel is False:
            return None, "use_kernel=False"
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
        self._decode_norm = kd.rms_norm
        return ops, None

    def _buf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A reusable output buffer for decode steps (one token per row); None for prefill, whose shapes vary."""
        if shape[0] > self.max_batch:
            return None
        key = (name, shape, dtype)
        b = self._bufs.get(key)
        if b is None:
            b = self._bufs[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return b

    def linears(self) -> list[Linear]:
        return [self.lm_head] + [m for layer in self.layers for m in layer.linears()]

    def set_kernel_max_tokens(self, n: int):
        for lin in self.linears():
            lin.kernel_max_tokens = n
            if lin.packed is not None and n >= Linear.kernel_max_tokens:
                lin.weight = None  # the kernel serves every token count: drop torch's copy of the weight

    def _attention(self, i: int, h: torch.Tensor, B: int, T: int, pos: int, qkv_proj, o_proj):
        cfg = self.cfg
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = qkv_proj(h, out=self._buf("qkv", (B * T, (nh + 2 * nkv) * d), h.dtype)).view(B, T, nh + 2 * nkv, d)
        q = qkv[:, :, :nh].transpose(1, 2)
        k = qkv[:, :, nh : nh + nkv].transpose(1, 2)
        v = qkv[:, :, nh + nkv :].transpose(1, 2)
        cos, sin = self.cos[pos : pos + T], self.sin[pos : pos + T]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        kc, vc = self.cache.k[i, :B], self.cache.v[i, :B]
        kc[:, :, pos : pos + T] = k
        vc[:, :, pos : pos + T] = v
        L = pos + T
        keys, values = kc[:, :, :L], vc[:, :, :L]
        scale = d**-0.5
        window = cfg.sliding_window
        if T == 1 and (window is None or L <= window):
            # One query per sequence: attend per KV head with its group of query heads (no repeat of K/V).
            o = F.scaled_dot_product_attention(q.reshape(B, nkv, nh // nkv, d), keys, values, scale=scale)
        elif pos == 0 and (window is None or L <= window):
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=nh != nkv)
        else:
            qi = torch.arange(pos, L, device=h.device)[:, None]
            kj = torch.arange(L, device=h.device)[None, :]
            mask = kj <= qi
            if window is not None:
                mask &= kj > qi - window
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=nh != nkv)
        o = o.reshape(B, nh, T, d).transpose(1, 2).reshape(B * T, nh * d)
        return o_proj(o, out=self._buf("o", (B * T, cfg.hidden_size), h.dtype))

    def _moe(self, i: int, x: torch.Tensor, h: torch.Tensor, router: Linear, count_rows: bool) -> torch.Tensor:
        """x + MoE(h) for layer i: route, hand the experts to the executor, then the executor's hook that
        sees the residual stream after each MoE layer (e.g. to guess and prefetch the next layer's experts
        with its router, as Mixtral-Offloading does)."""
        cfg = self.cfg
        idx, w = route(router(h, out=self._buf("router", (h.shape[0], cfg.num_experts), h.dtype)), cfg.top_k, self.dtype)
        if count_rows:  # decode with several rows (beams): distinct experts per layer, for the decode bound
            self.multi_row_expert_loads += int((torch.bincount(idx.flatten(), minlength=cfg.num_experts) > 0).sum())
            self.multi_row_layer_steps += 1
        x = x + self.executor.forward(i, h, idx, w)
        self.executor.after_moe(i, x)
        return x

    def _decode_step(self, tokens: torch.Tensor, pos: int, all_logits: bool) -> torch.Tensor:
        """forward() for T == 1 with the fused kernels (see the class docstring); same results contract."""
        cfg, eps, dt = self.cfg, self.cfg.rms_norm_eps, self.dtype
        B, H = tokens.shape[0], cfg.hidden_size
        norm, attend = self._decode_norm, self._decode_ops
        if attend.k_cache is not self.cache.k or attend.v_cache is not self.cache.v:
            raise RuntimeError("the KV cache was replaced after the decode kernels were bound to it")
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        buf_n1, buf_n2 = self._buf("norm1", (B, H), dt), self._buf("norm2", (B, H), dt)
        buf_qkv = self._buf("qkv", (B, (nh + 2 * nkv) * d), dt)
        buf_att, buf_o = self._buf("attn", (B, nh * d), dt), self._buf("o", (B, H), dt)
        x = F.embedding(tokens.reshape(-1), self.embed)  # [B, H]
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv_proj(norm(x, layer.input_norm, eps, out=buf_n1), out=buf_qkv)
            x = x + layer.o_proj(attend(i, qkv, pos, buf_att), out=buf_o)
            x = self._moe(i, x, norm(x, layer.post_norm, eps, out=buf_n2), layer.router, B > 1)
        xn = norm(x, self.norm, eps, out=self._buf("norm_f", (B, H), dt))
        if all_logits:
            return self.lm_head(xn, out_dtype=torch.float32).view(B, 1, -1)
        # Note: decode logits live in a reused buffer, valid until the next forward call.
        return self.lm_head(xn, out_dtype=torch.float32, out=self._buf("logits", (B, cfg.vocab_size), torch.float32))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, *, all_logits: bool = False) -> torch.Tensor:
        """tokens [B, T] at positions start_pos.. -> fp32 logits [B, V] of the last position
        (or [B, T, V] with all_logits)."""
        B, T = tokens.shape
        if start_pos + T > self.max_seq_len:
            raise ValueError(f"sequence length {start_pos + T} exceeds the KV cache size max_seq_len={self.max_seq_len}")
        if B > self.max_batch:
            raise ValueError(f"batch {B} exceeds max_batch={self.max_batch}")
        if T == 1 and self.decode_fastpath and self._decode_ops is not None and tokens.device.type == "cpu":
            return self._decode_step(tokens, start_pos, all_logits)
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        x = F.embedding(tokens.reshape(-1), self.embed)  # [B*T, H]
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, rms_norm(x, layer.input_norm, eps), B, T, start_pos, layer.qkv_proj,
                                    layer.o_proj)
            x = self._moe(i, x, rms_norm(x, layer.post_norm, eps), layer.router, T == 1 and B > 1)
        if all_logits:
            return self.lm_head(rms_norm(x, self.norm, eps), out_dtype=torch.float32).view(B, T, -1)
        x = x.view(B, T, -1)[:, -1].contiguous()
        # Note: decode logits live in a reused buffer, valid until the next forward call.
        return self.lm_head(rms_norm(x, self.norm, eps), out_dtype=torch.float32,
                            out=self._buf("logits", (B, cfg.vocab_size), torch.float32))
