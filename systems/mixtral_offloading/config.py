"""Options of `system=mixtral_offloading` (conf/system/mixtral_offloading.yaml)."""
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
    schema_name = "mixtral_offloading_schema"

    cache_size: Optional[int] = None  # experts per layer on the GPU; None = derived from the GPU budget
    default_cache_size: int = DEFAULT_CACHE_SIZE  # when cache_size is None and there is no GPU budget
    prefetch: bool = True
    prefetch_k: Optional[int] = None  # None = the model's top_k
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
