"""`system=mixtral_offloading` and its preset `mixtral_offloading_original`: the options and their defaults."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from systems.base import check
from systems.engine_config import EngineSystemConfig

from .cache import DEFAULT_CACHE_SIZE


class PrefetchInput(Enum):
    residual = "residual"  # hidden state after the layer's MoE output is added
    moe_input = "moe_input"  # the layer's (normed) expert input


@dataclass
class MixtralOffloadingConfig(EngineSystemConfig):
    """Mixtral-Offloading's policy (Eliseev & Mazur, arXiv 2312.17238) re-implemented in fiddler's engine.
    Every expert in host memory, a per-layer LRU cache of experts on the GPU (misses are copied in, experts
    never run on the CPU), speculative prefetch of the next layer's experts with its router. Without CUDA the
    "GPU side" is the CPU device (the copies are real memcpys). quantize: true needs `pip install hqq` (the
    extra: pip install -e ".[offloading]"); otherwise the record is `skipped` with the reason."""

    label = "Mixtral-Offloading (ours, prefetch)"
    paper_row = 8
    paper_role = "baseline"

    name: str = "mixtral_offloading"
    adapter: str = "systems.mixtral_offloading.adapter:MixtralOffloadingAdapter"
    # experts per layer on the GPU; None = derived from the GPU budget:
    #   (budget - non-expert weights - KV cache - activations) / (layers x expert bytes), >= 1
    cache_size: Optional[int] = None
    # used when cache_size is None and there is no GPU budget (CPU-only, gpu.memory_gb=0): 2 of 8 per layer =
    # the original demo's "offload 6 of 8" spirit
    default_cache_size: int = DEFAULT_CACHE_SIZE
    prefetch: bool = True  # speculative loading of the next layer's likely experts
    prefetch_k: Optional[int] = None  # experts guessed per layer; None = the model's top_k (capped at cache_size)
    prefetch_input: PrefetchInput = PrefetchInput.residual
    quantize: bool = False  # HQQ: attention 4-bit g64, experts 2-bit g16 (needs the hqq package)
    # mode=simulate only: model the original repository's expert swap, where every miss also copies the
    # evicted expert back to host memory on the same CUDA stream (its ExpertCache._swap); this executor
    # keeps host copies and never writes back, so execute mode refuses it
    original_swap: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("cache_size", "prefetch_k"):
            v = getattr(self, key)
            if v is not None:
                check(lambda: v >= 1, f"system.{key}", v, "null or an integer >= 1")
        check(lambda: self.default_cache_size >= 1, "system.default_cache_size", self.default_cache_size,
              "an integer >= 1")

    def sim_policy(self):
        from systems.base import SystemUnavailable

        from .sim import MixtralOffloadingSimPolicy

        if self.quantize:
            raise SystemUnavailable("mixtral_offloading with quantize=true has no simulation model (HQQ expert "
                                    "sizes and dequantization cost are not modelled); simulate quantize=false")

        return MixtralOffloadingSimPolicy(self.cache_size, self.default_cache_size, self.prefetch, self.prefetch_k,
                                          original_swap=self.original_swap)


@dataclass
class MixtralOffloadingOriginalConfig(MixtralOffloadingConfig):
    """Mixtral-Offloading as its authors' released code runs (github.com/dvmazur/mixtral-offloading), for
    mode=simulate. On-demand loading only (the released code has no speculative prefetch) and every miss a swap
    that also copies the evicted expert back to host memory, on the stream the experts compute on
    (systems/mixtral_offloading/sim.py). `system=mixtral_offloading` is this project's re-implementation. The
    cache size is derived from the GPU budget like the re-implementation's; the Fiddler authors' Ada 6000 runs
    set offload_per_layer = 5 (system.cache_size=3), which runners/validate_sim.py uses for them."""

    label = "Mixtral-Offloading"
    paper_row = 2
    paper_name = "mixtral_offloading"
    today = False

    name: str = "mixtral_offloading_original"
    prefetch: bool = False
    original_swap: bool = True
