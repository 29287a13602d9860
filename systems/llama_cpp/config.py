"""`system=llama_cpp` and its presets `llama_cpp_cpu_moe` and `llama_cpp_original`: the options and their defaults."""
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
    """llama.cpp through llama-cpp-python, on the run's own checkpoint converted to GGUF. Cached under
    ${cache_dir}/llama_cpp/gguf and fed the same prompt token ids (install: docs/systems.md, the llamacpp extra)."""

    label = "llama.cpp (today)"
    extra = "llamacpp"
    paper_row = 6
    paper_role = "baseline"

    name: str = "llama_cpp"
    adapter: str = "systems.llama_cpp.adapter:LlamaCppAdapter"
    # GGUF type: f32 | f16 | bf16 | q8_0 (converter) or llama.cpp's quantizer types (q4_0 q4_1 q5_0 q5_1 q2_k
    # q3_k_s q3_k_m q3_k_l q4_k_s q4_k_m q5_k_s q5_k_m q6_k iq4_nl iq4_xs)
    quant: str = "bf16"
    # q8_0 / q4_0 only: "pure" = like for like with fiddler's system.quant (experts and attention in the
    # type, embeddings and output matrix bf16); "llama" = llama.cpp's own mix for the type
    quant_policy: QuantPolicy = QuantPolicy.pure
    # -ngl: layers on the GPU; -1 = all (> 0 needs a GPU build); None = as many whole layers as the GPU budget
    # holds (0 without CUDA)
    n_gpu_layers: Optional[int] = None
    n_cpu_moe: int = 0  # --n-cpu-moe: expert FFNs of the first N layers stay in host memory; -1 = as few as the budget needs
    n_ctx: Optional[int] = None  # KV-cache cells; None = 4096 (<= training context), grown when a request needs more
    n_batch: int = 512  # prompt tokens per llama_decode
    flash_attn: OnOffAuto = OnOffAuto.auto
    threads: Optional[int] = None  # n_threads and n_threads_batch; None = environment.cpu.threads
    converter_dir: Optional[str] = None  # llama.cpp source tree with convert_hf_to_gguf.py; None = fetched to the cache
    verbose: bool = False  # print llama.cpp's log
    kv_cache_type: str = "f16"  # llama.cpp's default; also bf16, f32, q8_0, q4_0
    # true: llama.cpp as the paper ran it (a 2024 build with llama_beam_search), mode=simulate only
    # (systems/llama_cpp/original_sim.py); the preset llama_cpp_original below
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

    def thread_count(self, env_threads: int) -> int:
        return int(self.threads if self.threads is not None else env_threads)

    def sim_policy(self):
        if self.original:
            from .original_sim import LlamaCppOriginalSimPolicy

            return LlamaCppOriginalSimPolicy(self.n_gpu_layers, self.n_cpu_moe, self.quant, self.n_batch, self.n_ctx,
                                             self.kv_cache_type, beam_prefix=self.beam_prefix)
        from .sim import LlamaCppSimPolicy

        return LlamaCppSimPolicy(self.n_gpu_layers, self.n_cpu_moe, self.quant, self.n_batch, self.n_ctx,
                                 self.kv_cache_type)


@dataclass
class LlamaCppCpuMoeConfig(LlamaCppConfig):
    """llama.cpp with expert offload (--n-cpu-moe) instead of whole layers (-ngl). Every layer's attention,
    norms, router and KV cache on the GPU, and the expert FFNs of as few first layers as the budget needs in
    host memory (systems/llama_cpp/layers.py). A later llama.cpp feature than the paper's baseline."""

    label = "llama.cpp --n-cpu-moe"
    paper_row = 7

    name: str = "llama_cpp_cpu_moe"  # a preset is a system with its own name in records, tables and figures
    n_cpu_moe: int = -1


@dataclass
class LlamaServerConfig(LlamaCppConfig):
    """llama.cpp's own HTTP server (llama-server) with continuous batching over serve.slots parallel slots, on the
    same GGUF as system=llama_cpp, built from the same llama.cpp source with the same CPU flags
    (scripts/install.sh --llama-server; systems/llama_cpp/server_build.py). mode=serve and workload=serving
    only; system=llama_cpp serves through llama-cpp-python's server, one request at a time."""

    label = "llama.cpp llama-server"
    paper_row = None
    paper_role = None

    name: str = "llama_cpp_server"  # a preset is a system with its own name in records, tables and figures
    adapter: str = "systems.llama_cpp.server_adapter:LlamaServerAdapter"


@dataclass
class LlamaCppOriginalConfig(LlamaCppConfig):
    """llama.cpp as the paper ran it, for mode=simulate: a 2024 build with llama_beam_search. That call was
    removed on 2024-06-04 (ggml-org/llama.cpp 0cd6bd3); -ngl whole layers that fit the GPU, beam search one
    llama_decode per beam per step over the tokens since the beams' common prefix plus the newly common prefix
    once, and prompt batches >= 32 rows offloaded to the GPU with their host weights
    (systems/llama_cpp/original_sim.py, every choice cited there). `system=llama_cpp` is today's llama.cpp
    (beams as parallel sequences)."""

    label = "llama.cpp (2024, llama_beam_search)"
    paper_row = 1
    paper_name = "llama_cpp"
    today = False

    name: str = "llama_cpp_original"
    quant: str = "f16"  # that build's CUDA backend had no BF16 (original_sim.PARAMS gguf_type)
    original: bool = True
