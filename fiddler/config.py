"""MoE model description read from a checkpoint's Hugging Face config.json.

Everything the engine, placement and latency model need to know about the architecture comes from
here; nothing is hard-coded per model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# model_type -> architecture class names we accept. Only Mixtral's layout (per-expert w1/w3/w2, softmax
# top-k router renormalised over the chosen experts, GQA attention with default rope) is implemented.
SUPPORTED = {"mixtral": ("MixtralForCausalLM",)}


@dataclass
class MoEConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_experts: int
    top_k: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    model_type: str = "mixtral"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in [1, num_experts={self.num_experts}]")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @classmethod
    def from_dict(cls, cfg: dict) -> "MoEConfig":
        model_type = cfg.get("model_type")
        archs = tuple(cfg.get("architectures") or ())
        if model_type not in SUPPORTED or (archs and not set(archs) & set(SUPPORTED[model_type])):
            supported = ", ".join(f"{k} ({'/'.join(v)})" for k, v in SUPPORTED.items())
            raise ValueError(
                f"unsupported model: model_type={model_type!r}, architectures={list(archs)}; "
                f"Fiddler supports MoE architectures: {supported}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (Mixtral experts use silu)")
        # transformers >= 5 nests rope settings in rope_parameters; Hub configs have top-level rope_theta.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r}; only default rotary embeddings are implemented")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 1e6))
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_experts=cfg["num_local_experts"],
            top_k=cfg["num_experts_per_tok"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=cfg.get("sliding_window"),
            model_type=model_type,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "MoEConfig":
        p = Path(path)
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file}: no config.json (expected a Hugging Face checkpoint directory)")
        with open(cfg_file) as f:
            return cls.from_dict(json.load(f))

    # ---- sizes (bytes) used for placement, budgets and the decode bound ----
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def expert_bytes(self, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> int:
        """One expert's w1 + w3 + w2 (quant: llama.cpp blocks, fiddler.quant)."""
        from .quant import weight_bytes

        h, f = self.hidden_size, self.intermediate_size
        return 2 * weight_bytes(f, h, quant, dtype) + weight_bytes(h, f, quant, dtype)

    def attention_bytes(self, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> int:
        """q, k, v, o projections of one layer (quant: llama.cpp blocks, fiddler.quant)."""
        from .quant import weight_bytes

        h, d = self.hidden_size, self.head_dim
        return (weight_bytes((self.num_heads + 2 * self.num_kv_heads) * d, h, quant, dtype)
                + weight_bytes(h, self.num_heads * d, quant, dtype))

    def attention_params(self) -> int:
        """q, k, v, o projections of one layer."""
        h, d = self.hidden_size, self.head_dim
        return h * d * (2 * self.num_heads + 2 * self.num_kv_heads)

    def layer_non_expert_params(self) -> int:
        """Attention, router and the two RMSNorms of one layer."""
        return self.attention_params() + self.num_experts * self.hidden_size + 2 * self.hidden_size

    def non_expert_bytes(self, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> int:
        """Everything but the experts: embeddings, per-layer attention/router/norms, final norm, lm_head
        (quant: the attention projections as llama.cpp blocks; the rest stays in dtype)."""
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else emb
        params = emb + head + self.hidden_size + self.num_layers * self.layer_non_expert_params()
        attn_dense = self.num_layers * self.attention_params() * dtype.itemsize
        return params * dtype.itemsize - attn_dense + self.num_layers * self.attention_bytes(dtype, quant)

    def kv_cache_bytes(self, seq_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        return 2 * self.num_layers * batch * self.num_kv_heads * seq_len * self.head_dim * dtype.itemsize

    def decode_bytes_per_token(
        self, kv_len: int, dtype: torch.dtype = torch.bfloat16, batch: int = 1, experts_per_layer: float | None = None,
        quant: str | None = None,
    ) -> float:
        """Bytes a decode step must read from memory at least: the active experts (`experts_per_layer`
        distinct ones per layer, if known from the routing; else top_k * batch capped at num_experts),
        attention projections, router, norms, lm_head and the KV cache of `batch` rows at length kv_len.
        The embedding row is negligible and ignored. quant: experts and attention projections as
        llama.cpp blocks (fiddler.quant), the rest in dtype."""
        s = dtype.itemsize
        if experts_per_layer is None:
            experts_per_layer = min(self.top_k * batch, self.num_experts)
        experts = experts_per_layer * self.num_layers * self.expert_bytes(dtype, quant)
        per_layer = (self.layer_non_expert_params() - self.attention_params()) * s + self.attention_bytes(dtype, quant)
        head = self.vocab_size * self.hidden_size * s + self.hidden_size * s
        return experts + self.num_layers * per_layer + head + self.kv_cache_bytes(kv_len, batch, dtype)
