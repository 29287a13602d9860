"""Which experts live in GPU memory (resident, decision kind a) under a memory budget.

The budget first pays for everything the GPU must hold regardless of placement -- non-expert weights,
the KV cache for max_seq_len x max_batch, the executor's copy buffers for experts streamed in over PCIe
(kind b) and the dense expert they are unpacked into, the activations of one forward pass, and on CUDA
the context and cuBLAS workspace -- each computed from the model shape (see `reservation`). What is
left holds whole experts: the most popular (layer, expert) pairs first
(popularity placement, the paper's policy), a seeded random set (ablation), or an explicit
fraction/mask (tests).

When the non-expert weights themselves do not fit (DeepSeek-V3's 17B dense parameters on a 24 GB card),
`dense_placement` keeps the embeddings/lm_head and as many whole layers as fit on the GPU -- the last
ones, like llama.cpp's -ngl -- and puts the other layers' attention, norms, router or dense MLP and their
KV cache on the CPU, where the model runs them (fiddler.model.MoETransformer layer_devices).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .popularity import Popularity

# The executor double-buffers copied-in experts: one buffer is computed on while the next expert is
# copied into the other (fiddler/executors/orchestrator.py uses exactly this many).
COPY_BUFFERS = 2
# The GPU side computes an expert's rows at most this many at a time (the executor, and the simulator's cost of
# it), so a long prompt reserves one chunk's intermediates, not its whole length's: Mixtral-8x7B at 32K tokens
# needs 4 GiB for one expert's gate/up/product rows, 0.5 GiB for 4096. The weights are read once per chunk, which
# 4096 rows' compute hides on any GPU.
EXPERT_ROW_CHUNK = 4096


def row_chunks(rows: int, most: int | None = None) -> list[tuple[int, int]]:
    """The [start, end) row ranges the GPU side computes an expert's `rows` in: as few as hold at most `most`
    (default EXPERT_ROW_CHUNK) rows each, of equal size to a row, so none is a sliver of a few rows (a GEMM of a few
    rows takes other kernels, and other roundings, than the same rows inside a big one)."""
    most = most or EXPERT_ROW_CHUNK
    k = max(1, -(-rows // most))
    size, extra = divmod(rows, k)
    bounds, start = [], 0
    for i in range(k):
        end = start + size + (i < extra)
        bounds.append((start, end))
        start = end
    return bounds


def activation_bytes(config, dtype: torch.dtype, max_seq_len: int, max_batch: int) -> dict[str, int]:
    """Peak transient GPU memory of one forward pass over max_batch x max_seq_len tokens (a full prefill).

    Counts the tensors fiddler/model.py and fiddler/executors/ create: the residual stream and its
    normed copy; attention q/k/v/output and the boolean mask of the masked SDPA path (SDPA's fused
    kernels do not materialise scores); the MoE block's per-slot outputs, one expert's gathered rows and
    intermediates for EXPERT_ROW_CHUNK rows (the GPU side computes an expert's rows in chunks that big; a
    dense layer's MLP runs on all T rows at once), CPU results copied back, routing indices; and fp32
    logits of the last position. Attention and MoE are not live at the same time.
    """
    s = dtype.itemsize
    T = max_seq_len * max_batch
    H, K = config.hidden_size, config.active_slots
    # gathered rows, output, gate, up, silu, product: of one expert's chunk of rows, or a dense layer's MLP's rows
    ffn = max(min(T, EXPERT_ROW_CHUNK) * (2 * H + 4 * config.intermediate_size),
              T * (2 * H + 4 * config.dense_intermediate_size) if config.dense_intermediate_size else 0)
    nh, nkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    residual = 2 * T * H * s
    if config.attention == "mla":  # queries, expanded keys/values (and the kv_b_proj output they come from), output
        dqk, dv = config.qk_head_dim, config.v_head_dim
        attention = T * nh * (2 * dqk + 2 * dv + config.qk_nope_head_dim + dv) * s
    else:
        attention = T * (2 * nh + 2 * nkv) * d * s
    attention += max_batch * max_seq_len * max_seq_len
    moe = (2 * T * K * H * s          # per-slot weighted outputs + CPU-expert results copied back
           + T * H * s                 # combined output
           + ffn * s                   # one expert's chunk of rows (or a dense MLP) in flight
           + 3 * T * K * 8)            # int64 sort order, token and slot indices
    logits = max_batch * config.vocab_size * 4
    return {"residual": residual, "attention_or_moe": max(attention, moe), "logits": logits}


def layer_dense_bytes(config, dtype: torch.dtype, max_seq_len: int, max_batch: int,
                      quant: str | None = None) -> list[int]:
    """Per decoder layer: its non-expert weights plus its share of the KV cache (what moves to the CPU
    together when the layer does not fit the GPU)."""
    kv = config.kv_cache_bytes(max_seq_len, max_batch, dtype) // config.num_layers
    return [_layer_weight_bytes(config, i, dtype, quant) + kv for i in range(config.num_layers)]


def _layer_weight_bytes(config, layer: int, dtype: torch.dtype, quant: str | None) -> int:
    """A decoder layer's non-expert weights (quant: its attention projections as llama.cpp blocks)."""
    delta = 0 if quant is None else config.attention_bytes(dtype, quant) - config.attention_params() * dtype.itemsize
    return config.layer_non_expert_params(layer) * dtype.itemsize + delta


def _copy_buffers(config, dtype: torch.dtype, quant: str | None) -> int:
    """The copy-in buffers: a copied-in expert arrives as the bytes host memory holds (packed, or blocks)."""
    return COPY_BUFFERS * int(config.expert_bytes(dtype, quant))


def _unpack_scratch(config, dtype: torch.dtype) -> int:
    """A copied-in expert is unpacked (bf16) or dequantized (quant) on the GPU side into one dense expert."""
    return int(config.expert_bytes(dtype))


@dataclass(frozen=True)
class DensePlacement:
    """Which decoder layers keep their dense part (attention, norms, router / dense MLP, KV cache) on the
    GPU side; embeddings, final norm and lm_head always do."""

    gpu_layers: tuple[bool, ...]

    @property
    def all_on_gpu(self) -> bool:
        return all(self.gpu_layers)

    @property
    def cpu_layers(self) -> list[int]:
        return [i for i, g in enumerate(self.gpu_layers) if not g]


def _fixed_reservation(config, dtype, max_seq_len, max_batch, quant=None, overhead=None) -> dict[str, int]:
    act = activation_bytes(config, dtype, max_seq_len, max_batch)
    return {"embeddings_and_head": int(config.embedding_params() * dtype.itemsize),
            "expert_copy_buffers": _copy_buffers(config, dtype, quant),
            "unpack_scratch": _unpack_scratch(config, dtype),
            "activations": int(sum(act.values())), **(overhead or {})}


def dense_placement(config, dtype: torch.dtype, budget_bytes: int | None, *, max_seq_len: int,
                    max_batch: int, quant: str | None = None, overhead: dict[str, int] | None = None) -> DensePlacement:
    """Every layer on the GPU when the whole reservation fits the budget (or there is no GPU: then the
    question does not arise and everything is on the one device); else embeddings/lm_head, copy buffers
    and activations first, then whole layers from the last one backwards while they fit (llama.cpp's
    -ngl order). Raises ValueError when not even the fixed part fits."""
    L = config.num_layers
    if budget_bytes is None:
        return DensePlacement((True,) * L)
    fixed = _fixed_reservation(config, dtype, max_seq_len, max_batch, quant, overhead)
    per_layer = layer_dense_bytes(config, dtype, max_seq_len, max_batch, quant)
    avail = budget_bytes - sum(fixed.values())
    if avail >= sum(per_layer):
        return DensePlacement((True,) * L)
    if avail < 0:
        parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in fixed.items())
        raise ValueError(
            f"GPU budget {budget_bytes} B ({budget_bytes / 2**30:.3f} GiB) is smaller than what the GPU side "
            f"needs with every layer's dense part on the CPU: {sum(fixed.values())} B = {parts} "
            f"(max_seq_len={max_seq_len}, max_batch={max_batch})")
    on = [False] * L
    for i in reversed(range(L)):
        if per_layer[i] > avail:
            break
        on[i] = True
        avail -= per_layer[i]
    return DensePlacement(tuple(on))


def reservation(config, dtype: torch.dtype, max_seq_len: int, max_batch: int,
                gpu_layers: Sequence[bool] | None = None, quant: str | None = None,
                overhead: dict[str, int] | None = None) -> dict[str, int]:
    """Bytes the GPU needs before any expert is made resident, by component. `gpu_layers` (default: all):
    the layers whose dense part and KV cache are on the GPU side (see dense_placement). quant: experts and
    attention projections as llama.cpp blocks (fiddler.quant). overhead: what the device needs besides
    tensors (GpuSide.overhead_bytes(): the CUDA context and cuBLAS workspace on CUDA)."""
    act = activation_bytes(config, dtype, max_seq_len, max_batch)
    if gpu_layers is None or all(gpu_layers):
        weights = int(config.non_expert_bytes(dtype, quant))
        kv = int(config.kv_cache_bytes(max_seq_len, max_batch, dtype))
    else:
        s = dtype.itemsize
        weights = config.embedding_params() * s + sum(_layer_weight_bytes(config, i, dtype, quant)
                                                      for i, g in enumerate(gpu_layers) if g)
        kv = config.kv_cache_bytes(max_seq_len, max_batch, dtype) // config.num_layers * sum(map(bool, gpu_layers))
    return {
        "non_expert_weights": int(weights),
        "kv_cache": int(kv),
        "expert_copy_buffers": _copy_buffers(config, dtype, quant),
        "unpack_scratch": _unpack_scratch(config, dtype),
        "activations": int(sum(act.values())),
        **(overhead or {}),
    }


@dataclass
class Placement:
    """resident[layer][expert] is True when that expert's weights live on the GPU."""

    resident: list[list[bool]]
    strategy: str
    expert_bytes: int
    budget_bytes: int | None = None
    reserved: dict[str, int] = field(default_factory=dict)
    seed: int | None = None
    gpu_layers: tuple[bool, ...] | None = None  # decoder layers whose dense part is on the GPU (None: all)

    @property
    def num_resident(self) -> int:
        return sum(map(sum, self.resident))

    @property
    def num_experts_total(self) -> int:
        return sum(map(len, self.resident))

    @property
    def resident_bytes(self) -> int:
        return self.num_resident * self.expert_bytes

    @property
    def gpu_bytes(self) -> int:
        """Everything this placement puts on the GPU: reservation plus resident experts."""
        return sum(self.reserved.values()) + self.resident_bytes

    def is_resident(self, layer: int, expert: int) -> bool:
        return self.resident[layer][expert]

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "seed": self.seed,
            "budget_bytes": self.budget_bytes,
            "reserved_bytes": dict(self.reserved),
            "expert_bytes": self.expert_bytes,
            "num_resident": self.num_resident,
            "num_experts_total": self.num_experts_total,
            "resident_fraction": self.num_resident / self.num_experts_total,
            "resident_bytes": self.resident_bytes,
            "resident_per_layer": [sum(r) for r in self.resident],
            "resident": [[e for e, r in enumerate(row) if r] for row in self.resident],
            "dense_cpu_layers": [i for i, g in enumerate(self.gpu_layers) if not g] if self.gpu_layers else [],
        }


def _mask_from_pairs(L: int, E: int, pairs) -> list[list[bool]]:
    m = [[False] * E for _ in range(L)]
    for l, e in pairs:
        m[l][e] = True
    return m


def place(config, dtype: torch.dtype, budget_bytes: int | None, *, max_seq_len: int, max_batch: int,
          strategy: str = "popularity", popularity: Popularity | None = None, seed: int = 0,
          fraction: float | None = None, mask: Sequence[Sequence[bool]] | None = None,
          quant: str | None = None, overhead: dict[str, int] | None = None) -> Placement:
    """Choose resident experts.

    strategy: "popularity" (most popular pairs first, as many as fit), "random" (seeded, as many as
    fit), "fraction" (the `fraction` most popular pairs, rounded down; must fit when a budget is given),
    "mask" (exactly `mask`; must fit when a budget is given). budget_bytes=None means no GPU:
    nothing is resident, whatever the strategy. quant: experts are held as llama.cpp blocks
    (fiddler.quant), so about 2x (q8_0) / 3.6x (q4_0) more of them fit. overhead: see `reservation`.
    """
    L, E = config.num_moe_layers, config.expert_slots
    eb = int(config.expert_bytes(dtype, quant))
    if budget_bytes is None:
        return Placement([[False] * E for _ in range(L)], "none (no GPU)", eb, None, {}, None)
    dense = dense_placement(config, dtype, budget_bytes, max_seq_len=max_seq_len, max_batch=max_batch, quant=quant,
                            overhead=overhead)
    gpu_layers = None if dense.all_on_gpu else dense.gpu_layers
    reserved = reservation(config, dtype, max_seq_len, max_batch, gpu_layers, quant, overhead)
    need = sum(reserved.values())
    if budget_bytes < need:  # cannot happen after dense_placement; kept as the invariant's check
        parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in reserved.items())
        raise ValueError(
            f"GPU budget {budget_bytes} B ({budget_bytes / 2**30:.3f} GiB) is smaller than the reservation "
            f"{need} B ({need / 2**30:.3f} GiB) = {parts} (max_seq_len={max_seq_len}, max_batch={max_batch})"
        )
    fit = min((budget_bytes - need) // eb, L * E)
    pop = Popularity.for_config(config, popularity)

    if strategy == "popularity":
        chosen = pop.ranking()[:fit]
    elif strategy == "random":
        pairs = [(l, e) for l in range(L) for e in range(E)]
        random.Random(seed).shuffle(pairs)
        chosen = pairs[:fit]
    elif strategy in ("fraction", "mask"):
        if strategy == "fraction":
            if fraction is None or not 0.0 <= fraction <= 1.0:
                raise ValueError(f"strategy 'fraction' needs 0 <= fraction <= 1, got {fraction!r}")
            chosen = pop.ranking()[: int(fraction * L * E + 1e-9)]
        else:
            if mask is None or len(mask) != L or any(len(r) != E for r in mask):
                raise ValueError(f"strategy 'mask' needs a {L} x {E} boolean mask")
            chosen = [(l, e) for l in range(L) for e in range(E) if mask[l][e]]
        if len(chosen) > fit:
            raise ValueError(
                f"{strategy} placement wants {len(chosen)} resident experts ({len(chosen) * eb} B) but the "
                f"budget {budget_bytes} B leaves room for {fit} after the reservation of {need} B"
            )
    else:
        raise ValueError(f"unknown placement strategy {strategy!r}; use popularity, random, fraction or mask")
    return Placement(_mask_from_pairs(L, E, chosen), strategy, eb, int(budget_bytes), reserved,
                     seed if strategy == "random" else None, gpu_layers)


def parse_placement(spec: str) -> tuple[str, dict[str, Any]]:
    """'popularity' | 'random' | 'fraction:0.5' | 'all' | 'none' -> (strategy, kwargs) for `place`."""
    if spec in ("popularity", "random"):
        return spec, {}
    if spec == "all":
        return "fraction", {"fraction": 1.0}
    if spec == "none":
        return "fraction", {"fraction": 0.0}
    if spec.startswith("fraction:"):
        try:
            return "fraction", {"fraction": float(spec.split(":", 1)[1])}
        except ValueError:
            pass
    raise ValueError(f"bad placement {spec!r}; use popularity, random, all, none or fraction:<0..1>")



def place_spec(spec, config, dtype: torch.dtype, budget_bytes: int | None, *, popularity, **kw) -> Placement:
    """A Placement as given, or `spec` (see parse_placement) placed by `place` with the model's popularity
    profile (fiddler.popularity.Popularity.for_config): the one step from a configured placement to
    resident experts, for the executor and its simulator alike."""
    if isinstance(spec, Placement):
        return spec
    strategy, skw = parse_placement(spec)
    return place(config, dtype, budget_bytes, strategy=strategy, popularity=Popularity.for_config(config, popularity),
                 **kw, **skw)
