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

from fiddler.kernels.constants import BLOCK_BYTES, QK, bits_per_weight

# Average bits per weight of llama.cpp's GGUF types (ggml block sizes: e.g. q8_0 stores 32 weights
# in 34 bytes = 8.5 bits); the *_s/_m/_l mixes use their main k-type's size plus the share of larger
# types llama.cpp's quantizer gives some tensors (approximate, from llama.cpp's quantize table).
BITS_PER_WEIGHT = {
    "f32": 32.0, "f16": 16.0, "bf16": 16.0, **{f: bits_per_weight(f) for f in BLOCK_BYTES},
    "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0,
    "q2_k": 2.96, "q3_k_s": 3.5, "q3_k_m": 3.91, "q3_k_l": 4.27, "q4_k_s": 4.58, "q4_k_m": 4.89,
    "q5_k_s": 5.54, "q5_k_m": 5.69, "q6_k": 6.56, "iq4_nl": 4.5, "iq4_xs": 4.25,
}
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, **{f: BLOCK_BYTES[f] / QK for f in BLOCK_BYTES}}

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


def layer_parts(config, quant: str = "bf16", n_ctx: int = 4096, kv_cache_type: str = "f16",
                layer: int | None = None) -> dict[str, int]:
    """Bytes of one decoder layer on the GPU (default: a MoE layer): `experts` (its expert FFNs, shared
    experts included; 0 for a dense layer), `rest` (attention, router, norms or a dense layer's MLP, its KV
    cache of n_ctx cells: K and V, or MLA's latent and rope key), and of the `output` layer (final norm +
    lm_head). `config` is a fiddler.config.MoEConfig."""
    w = _bytes_per_weight(quant)
    kv = config.kv_cache_row_elems() * n_ctx * KV_BYTES[kv_cache_type]
    dense = layer is not None and config.is_dense_layer(layer)
    return {"experts": 0 if dense else int(config.expert_slots * config.expert_params() * w),
            "rest": int(config.layer_non_expert_params(layer) * w + kv),
            "output": int((config.vocab_size + 1) * config.hidden_size * w)}


def gpu_layers(config, budget_bytes: int, quant: str = "bf16", n_ctx: int = 4096, kv_cache_type: str = "f16",
               overhead_bytes: int = OVERHEAD_BYTES) -> GpuLayers:
    """`-ngl` as large as fits (the paper's setup): whole layers from the last one down, then the output
    layer once every decoder layer is on. 0 when the budget does not cover the overhead."""
    L = config.num_layers
    sizes = [sum(layer_parts(config, quant, n_ctx, kv_cache_type, i)[k] for k in ("experts", "rest")) for i in range(L)]
    output_bytes = layer_parts(config, quant, n_ctx, kv_cache_type)["output"]
    free = int(budget_bytes) - overhead_bytes
    n, placed = 0, 0
    while n < L and free > 0 and placed + sizes[L - 1 - n] <= free:  # the last layers first
        placed += sizes[L - 1 - n]
        n += 1
    output = n == L and free - placed >= output_bytes
    used = overhead_bytes * (n > 0) + placed + output_bytes * output
    return GpuLayers(n_gpu_layers=n + output, n_cpu_moe=0, gpu_layers=n, gpu_expert_layers=n,
                     output_on_gpu=output, gpu_bytes=used, budget_bytes=int(budget_bytes))


def cpu_moe_layers(config, budget_bytes: int, quant: str = "bf16", n_ctx: int = 4096, kv_cache_type: str = "f16",
                   overhead_bytes: int = OVERHEAD_BYTES) -> GpuLayers:
    """`-ngl` all plus `--n-cpu-moe N` with N as small as fits: every layer's attention, norms, router,
    KV cache and the output layer on the GPU, the expert FFNs of the first N layers in host memory.
    When even N = n_layers does not fit, falls back to :func:`gpu_layers`."""
    parts = layer_parts(config, quant, n_ctx, kv_cache_type)
    L = config.num_layers
    base = overhead_bytes + sum(layer_parts(config, quant, n_ctx, kv_cache_type, i)["rest"] for i in range(L)) \
        + parts["output"]
    free = int(budget_bytes) - base
    if free < 0:
        return gpu_layers(config, budget_bytes, quant, n_ctx, kv_cache_type, overhead_bytes)
    # expert FFNs of the last layers first (--n-cpu-moe keeps the first N in host memory); dense layers have none
    on_gpu, used_e = 0, 0
    while on_gpu < L:
        e = layer_parts(config, quant, n_ctx, kv_cache_type, L - 1 - on_gpu)["experts"]
        if used_e + e > free:
            break
        used_e += e
        on_gpu += 1
    return GpuLayers(n_gpu_layers=L + 1, n_cpu_moe=L - on_gpu, gpu_layers=L, gpu_expert_layers=on_gpu,
                     output_on_gpu=True, gpu_bytes=base + used_e, budget_bytes=int(budget_bytes))
