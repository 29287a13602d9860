"""The GPU side's decode step with its dense part as CUDA graphs (issue 51).

At small batch a decode step is bound by launches, not bytes: each decoder layer's dense part (norms, the
q/k/v projection, rope, the KV-cache write, attention, o_proj and the router) is about a dozen kernels of
microseconds each. Here each layer's dense part is captured once per batch size as a CUDA graph and
replayed, one launch; the expert work, whose plan changes every step (which experts, where), runs eagerly
between the replays through the executor as always (kTransformers captures its hybrid decode the same way).

A graph replays fixed addresses and shapes, so the dense part is written in static form: the positions
are a device tensor written once per step, rope gathers its table rows by position, the cache write is
indexed by them, and attention reads each row's whole cache length under a mask (keys past the row's
position, or outside the sliding window, masked out). Masked keys add exact zeros to the softmax, so this
is the same function as the eager step's attention over the prefix; its summation order may differ.

Where there is no CUDA (an emulated GPU side) the same static ops run eagerly every step: the CPU tests
prove that the op sequence the graphs capture computes the eager decode's function, and the device check
compares replay with the eager path on a GPU (graphs need CUDA).

Scope: decode steps whose rows are the cache rows 0..B-1 (one request or its beams; continuous batching
with scattered rows runs eagerly), every layer's dense part on the GPU side, GQA attention with rotate-half
rope, MoE layers only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .model import fused_rms_norm, linear_add, rope_half_
from .step import Segment


def unsupported(model) -> str | None:
    """Why the graph decode step cannot serve this model, or None."""
    cfg = model.cfg
    if not all(layer.on_gpu for layer in model.layers) or not model.gpu_head:
        return "every layer's dense part and the lm_head must be on the GPU side"
    if cfg.attention != "gqa" or cfg.rope_style != "half":
        return f"implemented for GQA attention with rotate-half rope, not {cfg.attention} / {cfg.rope_style}"
    if any(layer.mlp is not None for layer in model.layers):
        return "implemented for MoE layers only (this model has dense MLP layers)"
    if not all(model.cache.joint(i) for i in range(cfg.num_layers)):
        return "the KV cache is not one joint tensor on the GPU side"
    return None


class DecodeGraphs:
    """The decode step of `model` (fiddler.model.MoETransformer) with each layer's dense part static, and
    on CUDA captured per batch size (`capture`; default: on CUDA)."""

    def __init__(self, model, capture: bool | None = None):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"decode graphs: {why}")
        self.model = model
        self.device = model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("decode graphs: capture needs CUDA (an emulated GPU side runs the static ops eagerly)")
        cfg = model.cfg
        S = model.max_seq_len
        self._keys = torch.arange(S, device=self.device)
        self._heads = torch.arange(cfg.num_kv_heads, device=self.device)
        self._rows = torch.arange(model.cache.kv.shape[2], device=self.device)  # the cache's batch rows
        self._graphs: dict[int, list] = {}  # batch size -> per layer (graph, static input, outputs)
        self._pool = None
        self.replays = 0
        self.captured: list[int] = []

    def serves(self, segments: Sequence[Segment]) -> bool:
        """A decode step on rows 0..B-1 (one token each, every row's logits)."""
        return all(s.length == 1 and s.logits and s.slot == b for b, s in enumerate(segments))

    # ------------------------------------------------------------------ the static dense part

    def _dense(self, i: int, x: torch.Tensor, pos: torch.Tensor):
        """Layer i's dense part for rows 0..B-1 at positions pos [B] (a device tensor): (x + attention,
        the post-attention norm's output, expert ids, weights). No op depends on a host value that changes
        between steps."""
        m, cfg = self.model, self.model.cfg
        layer, eps = m.layers[i], cfg.rms_norm_eps
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        B = x.shape[0]
        qkv = layer.qkv_proj(fused_rms_norm(x, layer.input_norm, eps))
        if cfg.qk_norm or cfg.clip_qkv is not None:
            qkv = m._qk_norm_clip(layer, qkv, B, 1)
        qkv = qkv.view(B, 1, nh + 2 * nkv, d)
        qk = qkv[:, :, : nh + nkv].transpose(1, 2)  # [B, nh + nkv, 1, d]
        cos, _ = m._rope(x.device)
        rows_cos = cos.index_select(0, pos)[:, None, None, :]
        rows_sin = m._signed_sin(x.device).index_select(0, pos)[:, None, None, :]
        rope_half_(qk, rows_cos, rows_sin)  # as the eager GPU side's rope
        kv = qkv[:, 0, nh:].view(B, 2, nkv, d).transpose(0, 1)  # [2, B, nkv, d]
        j = m.cache._where[i][2]
        m.cache.kv[:, j, self._rows[:B, None], self._heads[None, :], pos[:, None]] = kv
        keys, values = m.cache.k[j, :B], m.cache.v[j, :B]  # [B, nkv, S, d]: every position, masked below
        visible = self._keys[None, :] <= pos[:, None]
        if cfg.sliding_window is not None:
            visible &= self._keys[None, :] > pos[:, None] - cfg.sliding_window
        q = qkv[:, 0, :nh].reshape(B, nkv, nh // nkv, d)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None, :], scale=m.scale)
        x = linear_add(layer.o_proj, o.reshape(B, nh * d), x)
        h = fused_rms_norm(x, layer.post_norm, eps)
        idx, w = m._route(layer, h, buffered=False)
        return x, h, idx, w

    # ------------------------------------------------------------------ the step

    def step(self, tokens: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """fp32 logits [B, V] of the decode step `segments` (serves() holds)."""
        m = self.model
        B = len(segments)
        pos = torch.tensor([s.start for s in segments], dtype=torch.int64)
        x = F.embedding(tokens.to(m.embed.device), m.embed)
        graphs = self._graphs.get(B) if self.capture else None
        if self.capture and graphs is None:
            return self._capture_step(B, x, pos)
        pos_dev = graphs[0][3] if graphs else pos.to(self.device)
        if graphs:
            pos_dev.copy_(pos, non_blocking=True)
        for i in range(len(m.layers)):
            if graphs:
                g, x_in, outs, _ = graphs[i]
                x_in.copy_(x)
                g.replay()
                self.replays += 1
                x_attn, h, idx, w = outs
            else:
                x_attn, h, idx, w = self._dense(i, x, pos_dev)
            x = m._experts(i, x_attn, h, idx, w, B > 1)
        return m.lm_head(m._final_norm(x), out_dtype=torch.float32)

    def _capture_step(self, B: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The first step at batch size B on CUDA: each layer's dense part runs once on a side stream (the
        step's real work, which also warms the kernels) and is then captured with its static input; the
        expert work runs eagerly as in every step."""
        m = self.model
        pos_dev = pos.to(self.device)
        captured = []
        for i in range(len(m.layers)):
            x_in = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x_attn, h, idx, w = self._dense(i, x_in, pos_dev)  # this step's result (and the warm-up)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                outs = self._dense(i, x_in, pos_dev)
            self._pool = g.pool()
            captured.append((g, x_in, outs, pos_dev))
            x = m._experts(i, x_attn, h, idx, w, B > 1)
        self._graphs[B] = captured
        self.captured.append(B)
        return m.lm_head(m._final_norm(x), out_dtype=torch.float32)
