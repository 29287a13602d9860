"""Loading MoE safetensors checkpoints (every family of fiddler.config.SUPPORTED) tensor by tensor.

Experts are read one at a time into host memory (the executor makes its own host copy of each, packed
and pinned as it needs, and frees the loaded one); non-expert weights go to the compute device. Each
tensor is read from the memory-mapped file, converted and placed before the next one is read, so the
model is never held twice. Every tensor returned is private memory, never a view of the mapping: the
checkpoint's mapping is released when loading returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import MoEConfig


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupted or does not match its config."""


@dataclass
class ExpertWeights:
    """One expert in Hugging Face layout: w1, w3 [ffn, hidden]; w2 [hidden, ffn]."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    # [2 ffn, hidden]: w1 and w3 stacked, where w1 and w3 are its two halves (views): the GPU side's copies,
    # so that both products are one GEMM launch (fiddler.executors.ffn.torch_expert)
    w13: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def stacked(cls, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        """A copy whose w1 and w3 are the halves of one [2 ffn, hidden] tensor (on w1's device and dtype)."""
        w13 = torch.cat([w1, w3.to(w1.device, w1.dtype)])
        F_ = w1.shape[0]
        return cls(w13[:F_], w13[F_:], w2, w13)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w1, self.w3, self.w2))


@dataclass
class LayerWeights:
    """One decoder layer's non-expert weights. GQA attention uses q, k, v, o (+ biases, q/k norms); MLA
    uses the fields in `mla` and o. A MoE layer has `gate` (the router); a dense layer has `mlp`."""

    input_norm: torch.Tensor
    q: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor | None  # router [num_experts, hidden]; None in a dense layer
    qkv_bias: torch.Tensor | None = None  # [q; k; v] biases (Qwen2-MoE)
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # Qwen3 (per head) / OLMoE (full width)
    k_norm: torch.Tensor | None = None
    mla: dict[str, torch.Tensor] | None = None  # q_proj | q_a_proj, q_a_norm, q_b_proj; kv_a_proj, kv_a_norm, kv_b_proj
    score_bias: torch.Tensor | None = None  # DeepSeek-V3 e_score_correction_bias [num_experts]
    shared_gate: torch.Tensor | None = None  # Qwen2-MoE shared_expert_gate [1, hidden]
    mlp: ExpertWeights | None = None  # a dense layer's MLP (gate, up, down)


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the same tensor as embed when tied
    experts: list[list[ExpertWeights]] = field(default_factory=list)  # [moe layer][slot], host memory


class _Checkpoint:
    """Maps tensor names to shard files and reads single tensors (or slices) with clear errors."""

    def __init__(self, path: Path):
        self.path = path
        self._handles: dict[Path, object] = {}
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: invalid safetensors index ({e})") from e
            self.file_of = {k: path / v for k, v in weight_map.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files (and no model.safetensors.index.json)")
            self.file_of = {}
            for f in files:
                for k in self._open(f).keys():
                    self.file_of[k] = f

    def _open(self, file: Path):
        if file in self._handles:
            return self._handles[file]
        if not file.is_file():
            raise CheckpointError(f"{file}: checkpoint shard is missing")
        try:
            h = safe_open(str(file), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: truncated or corrupted safetensors file: {e}") from e
        self._handles[file] = h
        return h

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str, shape: tuple[int, ...], index=None) -> torch.Tensor:
        """Read `name` (or `name[index]` without reading the rest) and check it has `shape`."""
        if name not in self.file_of:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found in the checkpoint")
        file = self.file_of[name]
        h = self._open(file)
        try:
            t = h.get_tensor(name) if index is None else h.get_slice(name)[index]
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} (truncated or corrupted file?): {e}") from e
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}"
            )
        return t

    def close(self):
        self._handles.clear()


def _place(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # .contiguous() so that slices read from fused tensors do not keep their parent alive; a CPU tensor that
    # needed no conversion is still a view of the file's mapping (a private one for safetensors): copy it,
    # so that the mapping goes with the handles and what the engine holds is anonymous memory.
    out = t.to(device=device, dtype=dtype).contiguous()
    if out.device.type == "cpu" and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
        out = out.clone()
    return out


def load_expert(ck: _Checkpoint, cfg: MoEConfig, layer: int, e: int, dtype: torch.dtype) -> ExpertWeights:
    h, f = cfg.hidden_size, cfg.intermediate_size
    cpu = torch.device("cpu")
    n1, n3, n2 = cfg.expert_names
    p = f"model.layers.{layer}.{cfg.moe_block}.experts.{e}"
    if f"{p}.{n1}.weight" in ck:  # original Hub layout
        w1 = _place(ck.get(f"{p}.{n1}.weight", (f, h)), dtype, cpu)
        w3 = _place(ck.get(f"{p}.{n3}.weight", (f, h)), dtype, cpu)
        w2 = _place(ck.get(f"{p}.{n2}.weight", (h, f)), dtype, cpu)
        return ExpertWeights(w1, w3, w2)
    # transformers >= 5 in-memory layout, in case a checkpoint was saved fused: gate_up_proj [E, 2F, H], down_proj [E, H, F]
    q = f"model.layers.{layer}.mlp.experts"
    if f"{q}.gate_up_proj" in ck:
        w1 = _place(ck.get(f"{q}.gate_up_proj", (f, h), (e, slice(0, f))), dtype, cpu)
        w3 = _place(ck.get(f"{q}.gate_up_proj", (f, h), (e, slice(f, 2 * f))), dtype, cpu)
        w2 = _place(ck.get(f"{q}.down_proj", (h, f), (e,)), dtype, cpu)
        return ExpertWeights(w1, w3, w2)
    raise CheckpointError(f"{ck.path}: no weights for layer {layer} expert {e} (looked for {p}.{n1}.weight)")


def _shared_prefix(cfg: MoEConfig, layer: int) -> str:
    name = "shared_experts" if cfg.model_type.startswith("deepseek") else "shared_expert"
    return f"model.layers.{layer}.{cfg.moe_block}.{name}"


def load_shared_slots(ck: _Checkpoint, cfg: MoEConfig, layer: int, dtype: torch.dtype) -> list[ExpertWeights]:
    """The shared expert(s) of a MoE layer as `cfg.shared_slots` experts of the routed shape: rows of gate/up
    and columns of down split along the intermediate dimension (the last chunk zero-padded), so that the
    sum of the chunks' outputs is the shared expert's output."""
    h, f, fs = cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size
    p = _shared_prefix(cfg, layer)
    g = ck.get(f"{p}.gate_proj.weight", (fs, h))
    u = ck.get(f"{p}.up_proj.weight", (fs, h))
    d = ck.get(f"{p}.down_proj.weight", (h, fs))
    cpu = torch.device("cpu")
    out = []
    for j in range(cfg.shared_slots):
        lo, hi = j * f, min((j + 1) * f, fs)
        w1, w3, w2 = g[lo:hi], u[lo:hi], d[:, lo:hi]
        if hi - lo < f:  # zero rows/columns contribute exactly nothing: silu(0) * 0 = 0
            pad = f - (hi - lo)
            w1 = torch.cat([w1, w1.new_zeros(pad, h)])
            w3 = torch.cat([w3, w3.new_zeros(pad, h)])
            w2 = torch.cat([w2, w2.new_zeros(h, pad)], dim=1)
        out.append(ExpertWeights(*(_place(w, dtype, cpu) for w in (w1, w3, w2))))
    return out


def load_weights(
    path: str | Path,
    cfg: MoEConfig,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    layer_devices: list[torch.device] | None = None,
) -> ModelWeights:
    """Load a checkpoint: non-expert weights on `device` (layer i's on layer_devices[i] when given: dense
    parts that do not fit the GPU stay on the CPU), experts in host memory as [moe layer][slot]."""
    path, device = Path(path), torch.device(device)
    ck = _Checkpoint(path)
    h, d, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size

    def get(name, shape, dev=device, dt=dtype):
        return _place(ck.get(name, shape), dt, dev)

    embed = get("model.embed_tokens.weight", (v, h))
    layers, experts = [], []
    for i in range(cfg.num_layers):
        dev = layer_devices[i] if layer_devices is not None else device
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        lw = LayerWeights(input_norm=get(f"{p}.input_layernorm.weight", (h,), dev), q=None, k=None, v=None,
                          o=None, post_norm=get(f"{p}.post_attention_layernorm.weight", (h,), dev), gate=None)
        if cfg.attention == "mla":
            nh, dqk = cfg.num_heads, cfg.qk_head_dim
            r, kvr = cfg.q_lora_rank, cfg.kv_lora_rank
            m = {}
            if r:
                m["q_a_proj"] = get(f"{a}.q_a_proj.weight", (r, h), dev)
                m["q_a_norm"] = get(f"{a}.q_a_layernorm.weight", (r,), dev)
                m["q_b_proj"] = get(f"{a}.q_b_proj.weight", (nh * dqk, r), dev)
            else:
                m["q_proj"] = get(f"{a}.q_proj.weight", (nh * dqk, h), dev)
            m["kv_a_proj"] = get(f"{a}.kv_a_proj_with_mqa.weight", (kvr + cfg.qk_rope_head_dim, h), dev)
            m["kv_a_norm"] = get(f"{a}.kv_a_layernorm.weight", (kvr,), dev)
            m["kv_b_proj"] = get(f"{a}.kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), kvr), dev)
            lw.mla = m
            lw.o = get(f"{a}.o_proj.weight", (h, nh * cfg.v_head_dim), dev)
        else:
            nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
            lw.q = get(f"{a}.q_proj.weight", (nq, h), dev)
            lw.k = get(f"{a}.k_proj.weight", (nkv, h), dev)
            lw.v = get(f"{a}.v_proj.weight", (nkv, h), dev)
            lw.o = get(f"{a}.o_proj.weight", (h, nq), dev)
            if cfg.qkv_bias:
                lw.qkv_bias = torch.cat([get(f"{a}.{x}_proj.bias", (n,), dev) for x, n in (("q", nq), ("k", nkv), ("v", nkv))])
            if cfg.o_bias:
                lw.o_bias = get(f"{a}.o_proj.bias", (h,), dev)
            if cfg.qk_norm:
                width = {"head": (d, d), "full": (nq, nkv)}[cfg.qk_norm]
                lw.q_norm = get(f"{a}.q_norm.weight", (width[0],), dev)
                lw.k_norm = get(f"{a}.k_norm.weight", (width[1],), dev)
        if cfg.is_dense_layer(i):
            fd = cfg.dense_intermediate_size
            lw.mlp = ExpertWeights(get(f"{p}.mlp.gate_proj.weight", (fd, h), dev),
                                   get(f"{p}.mlp.up_proj.weight", (fd, h), dev),
                                   get(f"{p}.mlp.down_proj.weight", (h, fd), dev))
        else:
            gate_name = f"{p}.{cfg.moe_block}.gate.weight"
            if gate_name not in ck and f"{p}.mlp.gate.weight" in ck:
                gate_name = f"{p}.mlp.gate.weight"
            # DeepSeek's router runs in fp32 (transformers keeps its weight in fp32 too)
            lw.gate = get(gate_name, (cfg.num_experts, h), dev, torch.float32 if cfg.router_fp32 else dtype)
            if cfg.topk_method == "noaux_tc":
                lw.score_bias = get(f"{p}.{cfg.moe_block}.gate.e_score_correction_bias", (cfg.num_experts,), dev,
                                    torch.float32)
            if cfg.shared_expert_gate:
                lw.shared_gate = get(f"{p}.{cfg.moe_block}.shared_expert_gate.weight", (1, h), dev)
            experts.append([load_expert(ck, cfg, i, e, dtype) for e in range(cfg.num_experts)]
                           + (load_shared_slots(ck, cfg, i, dtype) if cfg.shared_slots else []))
        layers.append(lw)
    norm = get("model.norm.weight", (h,))
    if cfg.tie_word_embeddings and "lm_head.weight" not in ck:
        lm_head = embed
    else:
        lm_head = get("lm_head.weight", (v, h))
    ck.close()
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head, experts=experts)
