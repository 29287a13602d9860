"""Options of `system=llama_cpp` (conf/system/llama_cpp.yaml)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from systems.base import SystemConfig, check

from .convert import PURE_TYPES, SUPPORTED_QUANTS

#: KV-cache element types the adapter can ask llama.cpp for (engine.KV_CACHE_TYPES maps them to ggml's)
KV_CACHE_TYPES = ("f16", "bf16", "f32", "q8_0", "q4_0")


class QuantPolicy(Enum):
    pure = "pure"    # like for like with fiddler: llama_model_quantize(pure, output and embeddings bf16)
    llama = "llama"  # llama.cpp's own mix for the type (converter q8_0; quantizer defaults otherwise)


class OnOffAuto(Enum):
    auto = "auto"
    on = "on"
    off = "off"


@dataclass
class LlamaCppConfig(SystemConfig):
    schema_name = "llama_cpp_schema"

    quant: str = "bf16"  # GGUF type: converter types f32/f16/bf16/q8_0 or llama.cpp's quantizer types
    # q8_0 / q4_0 only: "pure" = like for like with fiddler's system.quant (experts and attention in the
    # type, embeddings and output matrix bf16); "llama" = llama.cpp's own mix for the type
    quant_policy: QuantPolicy = QuantPolicy.pure
    n_gpu_layers: Optional[int] = None  # -ngl; -1 = all; None = as many as the GPU budget holds (0 without CUDA)
    n_cpu_moe: int = 0  # --n-cpu-moe: expert FFNs of the first N layers stay in host memory; -1 = as few as the budget needs
    n_ctx: Optional[int] = None  # None = derived from the request
    n_batch: int = 512
    flash_attn: OnOffAuto = OnOffAuto.auto
    threads: Optional[int] = None  # None = environment.cpu.threads
    converter_dir: Optional[str] = None  # llama.cpp source tree with convert_hf_to_gguf.py
    verbose: bool = False
    kv_cache_type: str = "f16"  # llama.cpp's default; also bf16, f32, q8_0, q4_0
    # true: llama.cpp as the paper ran it (a 2024 build with llama_beam_search), mode=simulate only
    # (systems/llama_cpp/original_sim.py); conf/system/llama_cpp_original.yaml
    original: bool = False
    beam_prefix: str = "measured"  # original only: measured | prompt | all_but_last (the beams' common prefix)

    def __post_init__(self) -> None:
        check(lambda: self.quant in SUPPORTED_QUANTS, "system.quant", self.quant, ", ".join(SUPPORTED_QUANTS))
        if self.n_gpu_layers is not None:
            check(lambda: self.n_gpu_layers >= -1, "system.n_gpu_layers", self.n_gpu_layers,
                  "null (derived from the GPU budget), -1 (all) or >= 0")
        check(lambda: self.n_cpu_moe >= -1, "system.n_cpu_moe", self.n_cpu_moe,
              "-1 (derived from the GPU budget) or an integer >= 0")
        check(lambda: self.n_batch >= 1, "system.n_batch", self.n_batch, "an integer >= 1")
        if self.n_ctx is not None:
            check(lambda: self.n_ctx >= 1, "system.n_ctx", self.n_ctx, "null or an integer >= 1")
        if self.threads is not None:
            check(lambda: self.threads >= 1, "system.threads", self.threads, "null or an integer >= 1")
        check(lambda: self.beam_prefix in ("measured", "prompt", "all_but_last"), "system.beam_prefix",
              self.beam_prefix, "measured, prompt or all_but_last")
        check(lambda: self.kv_cache_type in KV_CACHE_TYPES, "system.kv_cache_type", self.kv_cache_type,
              ", ".join(KV_CACHE_TYPES))
        check(lambda: not (self.kv_cache_type in ("q8_0", "q4_0") and self.flash_attn is OnOffAuto.off),
              "system.flash_attn", "off", "auto or on with a quantized KV cache (llama.cpp needs flash attention)")

    def sim_policy(self):
        if self.original:
            from .original_sim import LlamaCppOriginalSimPolicy

            return LlamaCppOriginalSimPolicy(self.n_gpu_layers, self.n_cpu_moe, self.quant, self.n_batch, self.n_ctx,
                                             self.kv_cache_type, beam_prefix=self.beam_prefix)
        from .sim import LlamaCppSimPolicy

        return LlamaCppSimPolicy(self.n_gpu_layers, self.n_cpu_moe, self.quant, self.n_batch, self.n_ctx,
                                 self.kv_cache_type)
