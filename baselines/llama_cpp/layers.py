"""How many layers llama.cpp puts on the GPU under a memory budget, as the Fiddler paper ran it
(`-ngl` as large as fits), and the `--n-cpu-moe` alternative (every layer on the GPU except the
expert FFNs of the first N layers).

One function for both modes: execute mode on a CUDA machine derives `system.n_gpu_layers` from the
environment's budget with it, and the simulator's llama.cpp policy (fiddler/sim, mode=simulate)
places the same layers. Pure arithmetic on the model shape: no llama.cpp, no CUDA.

llama.cpp's `-ngl N` offloads the last N decoder layers (weights and their KV cache); `N > n_layers`
also offloads the output layer (final norm + lm_head). The token embedding always stays in host
memory. What the GPU also needs (the CUDA context, llama.cpp's compute buffers) is an allowance,
`overhead_bytes`, not measured here.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Average bits per weight of llama.cpp's GGUF types (ggml block sizes: e.g. q8_0 stores 32 weights
# in 34 bytes = 8.5 bits); the *_s/_m/_l mixes use their main k-type's size plus the share of larger
# types llama.cpp's quantizer gives some tensors (approximate, from llama.cpp's quantize table).
BITS_PER_WEIGHT = {
    "f32": 32.0, "f16": 16.0, "bf16": 16.0, "q8_0": 8.5,
    "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0,
    "q2_k": 2.96, "q3_k_s": 3.5, "q3_k_m": 3.91, "q3_k_l": 4.27, "q4_k_s": 4.58, "q4_k_m": 4.89,
    "q5_k_s": 5.54, "q5_k_m": 5.69, "q6_k": 6.56, "iq4_nl": 4.5, "iq4_xs": 4.25,
}
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}

# CUDA context + llama.cpp's compute buffers (an allowance; llama.cpp's own log states them per run)
OVERHEAD_BYTES = 768 * 2**20


@dataclass(frozen=True)
class GpuLayers:
    """Where llama.cpp's layers go under a budget."""

    n_gpu_layers: int  # llama.cpp's -ngl value (n_layers + 1 = every layer and the output layer)
    n_cpu_moe: int  # llama.cpp's --n-cpu-moe value (expert FFNs of the first N layers in host memory)
    gpu_layers: int  # decoder layers whose attention (and KV cache) is on the GPU
    gpu_expert_layers: int  # decoder layers whose expert FFNs are on the GPU
    output_on_gpu: bool
    gpu_bytes: int  # what that placement puts on the GPU, overhead included
    budget_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bytes_per_weight(quant: str) -> float:
    try:
        return BITS_PER_WEIGHT[quant] / 8
    except KeyError:
        raise ValueError(f"unknown GGUF type {quant!r}; known: {', '.join(BITS_PER_WEIGHT)}") from None


def layer_parts(config, quant: str = "bf16", n_ctx: int = 4096, kv_cache_type: str = "f16") -> dict[str, int]:
    """Bytes of one decoder layer on the GPU: `experts` (its expert FFNs), `rest` (attention, router,
    norms, its KV cache of n_ctx cells), and of the `output` layer (final norm + lm_head).
    `config` is a fiddler.config.MoEConfig (or anything with its fields)."""
    w = _bytes_per_weight(quant)
    kv = 2 * config.num_kv_heads * config.head_dim * n_ctx * KV_BYTES[kv_cache_type]
    return {"experts": int(config.num_experts * config.expert_params() * w),
            "rest": int(config.layer_non_expert_params() * w + kv),
            "output": int((config.vocab_size + 1) * config.hidden_size * w)}


def gpu_layers(config, budget_bytes: int, quant: str = "bf16", n_ctx: int = 4096, kv_cache_type: str = "f16",
               overhead_bytes: int = OVERHEAD_BYTES) -> GpuLayers:
    """`-ngl` as large as fits (the paper's setup): whole layers from the last one down, then the output
    layer once every decoder layer is on. 0 when the budget does not cover the overhead."""
    parts = layer_parts(config, quant, n_ctx, kv_cache_type)
    per_layer = parts["experts"] + parts["rest"]
    free = int(budget_bytes) - overhead_bytes
    n = max(0, min(config.num_layers, free // per_layer)) if free > 0 else 0
    output = n == config.num_layers and free - n * per_layer >= parts["output"]
    used = overhead_bytes * (n > 0) + n * per_layer + parts["output"] * output
    return GpuLayers(n_gpu_layers=n + output, n_cpu_moe=0, gpu_layers=n, gpu_expert_layers=n,
                     output_on_gpu=output, gpu_bytes=used, budget_bytes=int(budget_bytes))


def cpu_moe_layers(config, budget_bytes: int, quant: str = "bf16", n_ctx: int = 4096, kv_cache_type: str = "f16",
                   overhead_bytes: int = OVERHEAD_BYTES) -> GpuLayers:
    """`-ngl` all plus `--n-cpu-moe N` with N as small as fits: every layer's attention, norms, router,
    KV cache and the output layer on the GPU, the expert FFNs of the first N layers in host memory.
    When even N = n_layers does not fit, falls back to :func:`gpu_layers`."""
    parts = layer_parts(config, quant, n_ctx, kv_cache_type)
    L = config.num_layers
    base = overhead_bytes + L * parts["rest"] + parts["output"]
    free = int(budget_bytes) - base
    if free < 0:
        return gpu_layers(config, budget_bytes, quant, n_ctx, kv_cache_type, overhead_bytes)
    on_gpu = min(L, free // parts["experts"])
    return GpuLayers(n_gpu_layers=L + 1, n_cpu_moe=L - on_gpu, gpu_layers=L, gpu_expert_layers=on_gpu,
                     output_on_gpu=True, gpu_bytes=base + on_gpu * parts["experts"], budget_bytes=int(budget_bytes))
