"""MoE model description read from a checkpoint's Hugging Face config.json.

Everything the engine, placement and latency model need to know about the architecture comes from
here; nothing is hard-coded per model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# model_type -> architecture class names we accept. One generic decoder covers them all; the families
# differ only in what `from_dict` reads (router, shared experts, attention kind, rope, weight names).
SUPPORTED = {
    "mixtral": ("MixtralForCausalLM",),
    "qwen3_moe": ("Qwen3MoeForCausalLM",),
    "qwen2_moe": ("Qwen2MoeForCausalLM",),
    "olmoe": ("OlmoeForCausalLM",),
    "deepseek_v2": ("DeepseekV2ForCausalLM",),
    "deepseek_v3": ("DeepseekV3ForCausalLM",),
}
_DEEPSEEK = ("deepseek_v2", "deepseek_v3")


class UnsupportedModelError(ValueError):
    """A config.json describes a feature the engine does not implement (the message names it)."""


class MissingConfigKey(KeyError, ValueError):
    """config.json lacks a key its family needs; args[0] is the key (a KeyError, as callers expect)."""

    def __init__(self, key: str, model_type: str | None):
        super().__init__(key)
        self.model_type = model_type

    def __str__(self) -> str:
        return f"{self.model_type} config.json lacks {self.args[0]!r}"


def _unsupported(model_type: str, feature: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{model_type}: unsupported feature: {feature}")


@dataclass
class MoEConfig:
    """One decoder-only MoE model. Fields beyond the Mixtral core default to Mixtral's choices.

    Experts as the executors see them ("slots"): each MoE layer has `expert_slots` = num_experts routed
    experts followed by `shared_slots` chunks of the shared expert(s), each chunk the routed experts'
    shape (a SwiGLU FFN splits exactly along its intermediate dimension; a remainder is zero-padded), so
    placement, the planner, the latency model and the CPU kernel handle them like any other expert. Every
    token uses `active_slots` = top_k + shared_slots of them."""

    hidden_size: int
    intermediate_size: int  # one routed expert's FFN width (HF: moe_intermediate_size where it differs)
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
    # ---- router
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum 1
    scoring_func: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    topk_method: str = "greedy"  # greedy | group_limited_greedy (DeepSeek-V2) | noaux_tc (V3: bias-corrected groups)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_fp32: bool = False  # router logits from fp32 weights and activations (DeepSeek)
    topk_sorted: bool = True  # torch.topk(sorted=...) as the reference calls it (slot order of the sum)
    # ---- shared experts (run for every token) and dense layers
    shared_intermediate_size: int = 0  # total width of the shared expert(s); 0: none
    shared_expert_gate: bool = False  # Qwen2-MoE: output scaled by sigmoid(x . w_gate)
    dense_layers: tuple[int, ...] = ()  # decoder layers with a dense MLP instead of a MoE block
    dense_intermediate_size: int = 0
    # ---- attention
    attention: str = "gqa"  # gqa | mla
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # None | "head" (Qwen3: per head) | "full" (OLMoE: over all heads)
    clip_qkv: float | None = None
    q_lora_rank: int | None = None  # MLA
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_style: str = "half"  # half (rotate_half) | complex (DeepSeek-V2 pairs) | interleave (V3 pairs)
    rope_scaling: dict | None = None  # None (default rope) or {"rope_type": "yarn", "factor", ...}
    # ---- where the weights are: a MoE layer's block prefix (router = <block>.gate.weight) and an expert's
    # gate (w1), up (w3) and down (w2) projection names
    moe_block: str = "block_sparse_moe"
    expert_names: tuple[str, str, str] = ("w1", "w3", "w2")

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in [1, num_experts={self.num_experts}]")
        rot = self.qk_rope_head_dim if self.attention == "mla" else self.head_dim
        if rot % 2:
            raise ValueError(f"rotary dimension ({rot}) must be even for rotary embeddings")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"grouped routing needs num_experts ({self.num_experts}) divisible by n_group "
                             f"({self.n_group}) and 1 <= topk_group ({self.topk_group}) <= n_group")
        self.dense_layers = tuple(sorted(int(i) for i in self.dense_layers))
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers {self.dense_layers} out of range for {self.num_layers} layers")
        if len(self.dense_layers) == self.num_layers:
            raise ValueError("a MoE model needs at least one MoE layer")
        if self.dense_layers and self.dense_intermediate_size <= 0:
            raise ValueError("dense layers need dense_intermediate_size > 0")
        self.expert_names = tuple(self.expert_names)

    # ---- the expert grid the executors, placement and popularity see
    @property
    def moe_layers(self) -> list[int]:
        """Decoder layers with a MoE block, in order; executor layer j is decoder layer moe_layers[j]."""
        dense = set(self.dense_layers)
        return [i for i in range(self.num_layers) if i not in dense]

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - len(self.dense_layers)

    @property
    def shared_slots(self) -> int:
        """Chunks of the routed experts' shape the shared expert(s) split into (0 without shared experts)."""
        return -(-self.shared_intermediate_size // self.intermediate_size) if self.shared_intermediate_size else 0

    @property
    def expert_slots(self) -> int:
        """Experts per MoE layer as the executor holds them: routed ones, then the shared chunks."""
        return self.num_experts + self.shared_slots

    @property
    def active_slots(self) -> int:
        """Experts each token runs per MoE layer: its top-k plus every shared chunk."""
        return self.top_k + self.shared_slots

    @property
    def rope_dim(self) -> int:
        """Dimensions rotary embeddings rotate per head."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def attn_v_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict) -> "MoEConfig":
        try:
            return cls._from_dict(cfg)
        except KeyError as e:
            raise MissingConfigKey(e.args[0], cfg.get("model_type")) from None

    @classmethod
    def _from_dict(cls, cfg: dict) -> "MoEConfig":
        model_type = cfg.get("model_type")
        archs = tuple(cfg.get("architectures") or ())
        if model_type not in SUPPORTED or (archs and not set(archs) & set(SUPPORTED[model_type])):
            supported = ", ".join(f"{k} ({'/'.join(v)})" for k, v in SUPPORTED.items())
            raise UnsupportedModelError(
                f"unsupported model: model_type={model_type!r}, architectures={list(archs)}; "
                f"Fiddler supports MoE architectures: {supported}"
            )
        mt = model_type
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise _unsupported(mt, f"hidden_act {act!r} (the experts are SwiGLU with silu)")
        for key in ("mlp_bias",):
            if cfg.get(key):
                raise _unsupported(mt, f"{key}=true (biases in the MLPs)")
        # transformers >= 5 nests rope settings in rope_parameters; Hub configs have top-level rope_theta.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 1e6 if mt == "mixtral" else 10000.0)))
        rope_scaling = None
        if rope_type == "yarn":
            if mt not in _DEEPSEEK:
                raise _unsupported(mt, "rope_type 'yarn' (implemented for DeepSeek's MLA only)")
            rope_scaling = {k: rope.get(k) for k in ("factor", "original_max_position_embeddings", "beta_fast",
                                                     "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                                                     "truncate")}
            rope_scaling["rope_type"] = "yarn"
            if rope_scaling["original_max_position_embeddings"] is None:
                rope_scaling["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings",
                                                                           cfg.get("max_position_embeddings"))
        elif rope_type != "default":
            raise _unsupported(mt, f"rope_type {rope_type!r} (default rotary embeddings, and YaRN for DeepSeek)")
        if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise _unsupported(mt, "partial_rotary_factor != 1")
        heads = cfg["num_attention_heads"]
        H = cfg["hidden_size"]
        kw: dict = dict(
            hidden_size=H,
            num_layers=cfg["num_hidden_layers"],
            top_k=cfg["num_experts_per_tok"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or H // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5 if mt == "mixtral" else 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            model_type=mt,
            rope_scaling=rope_scaling,
        )
        if mt == "mixtral":
            kw.update(intermediate_size=cfg["intermediate_size"], num_experts=cfg["num_local_experts"],
                      sliding_window=cfg.get("sliding_window"))
        elif mt in ("qwen3_moe", "qwen2_moe"):
            if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
                raise _unsupported(mt, "use_sliding_window=true")
            E = cfg.get("num_experts") or cfg["num_local_experts"]
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            mlp_only = set(cfg.get("mlp_only_layers") or ())
            dense = [i for i in range(kw["num_layers"]) if i in mlp_only or not (E > 0 and (i + 1) % step == 0)]
            kw.update(intermediate_size=cfg["moe_intermediate_size"], num_experts=E,
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", mt == "qwen3_moe")),
                      dense_layers=tuple(dense), dense_intermediate_size=cfg.get("intermediate_size", 0) if dense else 0,
                      moe_block="mlp", expert_names=("gate_proj", "up_proj", "down_proj"))
            if mt == "qwen3_moe":
                bias = bool(cfg.get("attention_bias", False))
                kw.update(qk_norm="head", qkv_bias=bias, o_bias=bias)
            else:
                kw.update(qkv_bias=bool(cfg.get("qkv_bias", True)),
                          shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                          shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")))
        elif mt == "olmoe":
            bias = bool(cfg.get("attention_bias", False))
            if cfg.get("head_dim") not in (None, H // heads):
                raise _unsupported(mt, "head_dim != hidden_size / num_attention_heads (k_norm width assumes it)")
            kw.update(intermediate_size=cfg["intermediate_size"], num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), qk_norm="full", qkv_bias=bias,
                      o_bias=bias, clip_qkv=cfg.get("clip_qkv"), moe_block="mlp",
                      expert_names=("gate_proj", "up_proj", "down_proj"))
        else:  # DeepSeek-V2 / V3: MLA, shared experts, grouped routing, first_k_dense_replace dense layers
            E = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
            if cfg.get("attention_bias"):
                raise _unsupported(mt, "attention_bias=true (MLA projections with biases)")
            if (cfg.get("moe_layer_freq", 1) or 1) != 1:
                raise _unsupported(mt, "moe_layer_freq != 1")
            first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
            v3 = mt == "deepseek_v3"
            method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
            scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
            if v3 and (method, scoring) != ("noaux_tc", "sigmoid"):
                raise _unsupported(mt, f"topk_method={method!r} with scoring_func={scoring!r} (V3 implements "
                                       "noaux_tc with sigmoid scores)")
            if not v3 and method not in ("greedy", "group_limited_greedy"):
                raise _unsupported(mt, f"topk_method={method!r}")
            if not v3 and scoring != "softmax":
                raise _unsupported(mt, f"scoring_func={scoring!r}")
            grouped = method != "greedy"
            n_shared = int(cfg.get("n_shared_experts") or 0)
            kw.update(
                intermediate_size=cfg["moe_intermediate_size"], num_experts=E,
                # transformers' V2 router never renormalises (whatever norm_topk_prob says); V3's follows it
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if v3 else False,
                scoring_func=scoring, topk_method=method,
                n_group=int(cfg.get("n_group") or 1) if grouped else 1,
                topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
                router_fp32=True, topk_sorted=False,
                shared_intermediate_size=n_shared * cfg["moe_intermediate_size"],
                dense_layers=tuple(range(min(first_dense, kw["num_layers"]))),
                dense_intermediate_size=cfg.get("intermediate_size", 0) if first_dense else 0,
                attention="mla", q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                v_head_dim=cfg["v_head_dim"], head_dim=cfg["qk_rope_head_dim"],
                num_kv_heads=heads,  # MLA: every head has its own (expanded) key and value
                rope_style="interleave" if v3 and cfg.get("rope_interleave", True) else ("half" if v3 else "complex"),
                moe_block="mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
            )
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "MoEConfig":
        p = Path(path)
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file}: no config.json (expected a Hugging Face checkpoint directory)")
        with open(cfg_file) as f:
            return cls.from_dict(json.load(f))

    # ---- sizes (bytes) used for placement, budgets, the decode bound and the simulator ----
    def expert_params(self) -> int:
        """One expert slot: a routed expert, or one chunk of the shared expert(s)."""
        return 3 * self.hidden_size * self.intermediate_size

    def expert_bytes(self, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> int:
        """One expert's w1 + w3 + w2 (quant: llama.cpp blocks, fiddler.kernels.constants)."""
        from .kernels.constants import matrix_bytes  # not fiddler.quant, which imports this module's users

        h, f = self.hidden_size, self.intermediate_size
        return 2 * matrix_bytes(f, h, quant, dtype.itemsize) + matrix_bytes(h, f, quant, dtype.itemsize)

    def attention_matrices(self) -> list[tuple[int, int]]:
        """[out, in] shapes of one layer's attention projection matrices (what quantization applies to)."""
        h = self.hidden_size
        if self.attention == "mla":
            nh, dqk = self.num_heads, self.qk_head_dim
            q = [(self.q_lora_rank, h), (nh * dqk, self.q_lora_rank)] if self.q_lora_rank else [(nh * dqk, h)]
            return q + [(self.kv_lora_rank + self.qk_rope_head_dim, h),
                        (nh * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                        (h, nh * self.v_head_dim)]
        d = self.head_dim
        return [((self.num_heads + 2 * self.num_kv_heads) * d, h), (h, self.num_heads * d)]

    def attention_bytes(self, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> int:
        """One layer's attention weights; quant: its projection matrices as llama.cpp blocks (fiddler.quant),
        biases and norms stay in dtype."""
        from .kernels.constants import matrix_bytes

        mats = self.attention_matrices()
        small = self.attention_params() - sum(o * i for o, i in mats)
        return sum(matrix_bytes(o, i, quant, dtype.itemsize) for o, i in mats) + small * dtype.itemsize

    def attention_params(self) -> int:
        """One layer's attention weights: projections (and their biases), q/k norms; for MLA the low-rank
        projections, their norms and the latent up-projection."""
        h = self.hidden_size
        if self.attention == "mla":
            nh, dqk = self.num_heads, self.qk_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * nh * dqk) if self.q_lora_rank \
                else h * nh * dqk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
                + self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + nh * self.v_head_dim * h
        d, nh, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        p = h * d * (2 * nh + 2 * nkv)
        if self.qkv_bias:
            p += (nh + 2 * nkv) * d
        if self.o_bias:
            p += h
        if self.qk_norm == "head":
            p += 2 * d
        elif self.qk_norm == "full":
            p += (nh + nkv) * d
        return p

    def is_dense_layer(self, layer: int) -> bool:
        return layer in self.dense_layers

    def layer_non_expert_params(self, layer: int | None = None) -> int:
        """Attention, the two RMSNorms and either the router (+ shared-expert gate) of a MoE layer or the
        dense MLP of a dense layer (default: a MoE layer). Shared experts are expert slots, not counted here."""
        h = self.hidden_size
        base = self.attention_params() + 2 * h
        if layer is not None and self.is_dense_layer(layer):
            return base + 3 * h * self.dense_intermediate_size
        return (base + self.num_experts * h + (h if self.shared_expert_gate else 0)
                + (self.num_experts if self.topk_method == "noaux_tc" else 0))  # V3's score-correction bias

    def embedding_params(self) -> int:
        """Embeddings, final norm and lm_head (not counted twice when tied)."""
        emb = self.vocab_size * self.hidden_size
        return emb + (0 if self.tie_word_embeddings else emb) + self.hidden_size

    def _attention_quant_delta(self, dtype: torch.dtype, quant: str | None) -> int:
        """Bytes a layer's attention changes by when its projections are held as `quant` blocks."""
        return 0 if quant is None else self.attention_bytes(dtype, quant) - self.attention_params() * dtype.itemsize

    def non_expert_bytes(self, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> int:
        """Everything but the expert slots: embeddings, per-layer attention/router/norms/dense MLPs, final
        norm, lm_head (quant: the attention projections as llama.cpp blocks; the rest stays in dtype)."""
        params = self.embedding_params() + sum(self.layer_non_expert_params(i) for i in range(self.num_layers))
        return params * dtype.itemsize + self.num_layers * self._attention_quant_delta(dtype, quant)

    def all_expert_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Every expert slot of every MoE layer (shared chunks zero-padded to the expert shape included)."""
        return self.num_moe_layers * self.expert_slots * self.expert_bytes(dtype)

    def kv_cache_row_elems(self) -> int:
        """Cache elements per layer, token and row: K and V of every KV head (GQA), or the compressed
        latent plus the shared rope key (MLA: what the engine caches, and the minimum any MLA engine must)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_cache_bytes(self, seq_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        return self.num_layers * batch * seq_len * self.kv_cache_row_elems() * dtype.itemsize

    def decode_bytes_per_token(
        self, kv_len: int, dtype: torch.dtype = torch.bfloat16, batch: int = 1, experts_per_layer: float | None = None,
        quant: str | None = None,
    ) -> float:
        """Bytes a decode step must read from memory at least: the active expert slots (`experts_per_layer`
        distinct ones per MoE layer, if known from the routing; else top_k * batch capped at num_experts,
        plus the shared slots every token runs), attention projections, routers, norms, dense MLPs, lm_head
        and the KV cache of `batch` rows at length kv_len. The embedding row is negligible and ignored.
        quant: experts and attention projections as llama.cpp blocks (fiddler.quant), the rest in dtype."""
        s = dtype.itemsize
        if experts_per_layer is None:
            experts_per_layer = min(self.top_k * batch, self.num_experts) + self.shared_slots
        experts = experts_per_layer * self.num_moe_layers * self.expert_bytes(dtype, quant)
        layers = (sum(self.layer_non_expert_params(i) for i in range(self.num_layers)) * s
                  + self.num_layers * self._attention_quant_delta(dtype, quant))
        head = self.vocab_size * self.hidden_size * s + self.hidden_size * s
        return experts + layers + head + self.kv_cache_bytes(kv_len, batch, dtype)
