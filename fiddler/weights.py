"""Loading Mixtral safetensors checkpoints tensor by tensor.

Experts are read one at a time into host memory (pinned when CUDA is present, so PCIe copies can be
asynchronous); non-expert weights go to the compute device. Each tensor is read from the memory-mapped
file, converted and placed before the next one is read, so the model is never held twice.
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

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w1, self.w3, self.w2))


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor  # router [num_experts, hidden]


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the same tensor as embed when tied
    experts: list[list[ExpertWeights]] = field(default_factory=list)  # [layer][expert], host memory


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


def _place(t: torch.Tensor, dtype: torch.dtype, device: torch.device, pin: bool = False) -> torch.Tensor:
    if pin:
        out = torch.empty(t.shape, dtype=dtype, pin_memory=True)
        out.copy_(t)
        return out
    # .contiguous() so that slices read from fused tensors do not keep their parent alive.
    return t.to(device=device, dtype=dtype).contiguous()


def load_expert(ck: _Checkpoint, cfg: MoEConfig, layer: int, e: int, dtype: torch.dtype, pin: bool) -> ExpertWeights:
    h, f = cfg.hidden_size, cfg.intermediate_size
    cpu = torch.device("cpu")
    p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
    if f"{p}.w1.weight" in ck:  # original Hub layout
        w1 = _place(ck.get(f"{p}.w1.weight", (f, h)), dtype, cpu, pin)
        w3 = _place(ck.get(f"{p}.w3.weight", (f, h)), dtype, cpu, pin)
        w2 = _place(ck.get(f"{p}.w2.weight", (h, f)), dtype, cpu, pin)
        return ExpertWeights(w1, w3, w2)
    # transformers >= 5 in-memory layout, in case a checkpoint was saved fused: gate_up_proj [E, 2F, H], down_proj [E, H, F]
    q = f"model.layers.{layer}.mlp.experts"
    if f"{q}.gate_up_proj" in ck:
        w1 = _place(ck.get(f"{q}.gate_up_proj", (f, h), (e, slice(0, f))), dtype, cpu, pin)
        w3 = _place(ck.get(f"{q}.gate_up_proj", (f, h), (e, slice(f, 2 * f))), dtype, cpu, pin)
        w2 = _place(ck.get(f"{q}.down_proj", (h, f), (e,)), dtype, cpu, pin)
        return ExpertWeights(w1, w3, w2)
    raise CheckpointError(f"{ck.path}: no weights for layer {layer} expert {e} (looked for {p}.w1.weight)")


def load_weights(
    path: str | Path,
    cfg: MoEConfig,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    pin_experts: bool | None = None,
) -> ModelWeights:
    """Load a Mixtral checkpoint: non-expert weights on `device`, experts in host memory."""
    path, device = Path(path), torch.device(device)
    if pin_experts is None:
        pin_experts = torch.cuda.is_available()
    ck = _Checkpoint(path)
    h, d, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size

    def get(name, shape):
        return _place(ck.get(name, shape), dtype, device)

    embed = get("model.embed_tokens.weight", (v, h))
    layers, experts = [], []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        gate_name = f"{p}.block_sparse_moe.gate.weight"
        if gate_name not in ck and f"{p}.mlp.gate.weight" in ck:
            gate_name = f"{p}.mlp.gate.weight"
        layers.append(
            LayerWeights(
                input_norm=get(f"{p}.input_layernorm.weight", (h,)),
                q=get(f"{p}.self_attn.q_proj.weight", (cfg.num_heads * d, h)),
                k=get(f"{p}.self_attn.k_proj.weight", (cfg.num_kv_heads * d, h)),
                v=get(f"{p}.self_attn.v_proj.weight", (cfg.num_kv_heads * d, h)),
                o=get(f"{p}.self_attn.o_proj.weight", (h, cfg.num_heads * d)),
                post_norm=get(f"{p}.post_attention_layernorm.weight", (h,)),
                gate=get(gate_name, (cfg.num_experts, h)),
            )
        )
        experts.append([load_expert(ck, cfg, i, e, dtype, pin_experts) for e in range(cfg.num_experts)])
    norm = get("model.norm.weight", (h,))
    if cfg.tie_word_embeddings and "lm_head.weight" not in ck:
        lm_head = embed
    else:
        lm_head = get("lm_head.weight", (v, h))
    ck.close()
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head, experts=experts)
