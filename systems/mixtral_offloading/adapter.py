"""`system=mixtral_offloading`: fiddler's engine running the Mixtral-Offloading policy
(systems/mixtral_offloading/executor.py) behind the common adapter interface."""
from __future__ import annotations

from typing import Any

from systems.engine_adapter import EngineAdapter

from .config import MixtralOffloadingConfig


class MixtralOffloadingAdapter(EngineAdapter):
    config: MixtralOffloadingConfig

    def executor_factory(self):
        from .executor import MixtralOffloadingPolicy

        c = self.config
        if c.original_swap:
            from systems.base import SystemUnavailable

            raise SystemUnavailable("system.original_swap=true models the original repository's expert swap in "
                                    "mode=simulate only; this executor keeps host copies and never writes back")
        if c.quantize:
            from .quant import require_hqq

            require_hqq()  # SystemUnavailable with the reason when hqq is missing or cannot run here
        return MixtralOffloadingPolicy(cache_size=c.cache_size, prefetch=c.prefetch, prefetch_k=c.prefetch_k,
                                       prefetch_input=c.prefetch_input.value, quantize=c.quantize,
                                       default_cache_size=c.default_cache_size, budget_source=self.budget_source)

    def info(self) -> dict[str, Any]:
        d = super().info()
        d["reimplementation"] = ("Mixtral-Offloading's policy re-implemented in fiddler's engine (the original, "
                                 "dvmazur/mixtral-offloading, is a research repository, not a package)")
        return d
