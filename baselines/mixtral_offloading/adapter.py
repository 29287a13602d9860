"""`system=mixtral_offloading`: fiddler's engine running the Mixtral-Offloading policy
(baselines/mixtral_offloading/executor.py) behind the common adapter interface."""
from __future__ import annotations

from typing import Any

from baselines.base import SystemUnavailable
from baselines.engine_adapter import EngineAdapter


def _enum_value(v):
    return getattr(v, "value", v)


class MixtralOffloadingAdapter(EngineAdapter):
    def executor_factory(self):
        from .executor import DEFAULT_CACHE_SIZE, MixtralOffloadingPolicy

        quantize = bool(self.options.get("quantize", False))
        if quantize:
            from .quant import require_hqq

            require_hqq()  # SystemUnavailable with the reason when hqq is missing or cannot run here
        return MixtralOffloadingPolicy(
            cache_size=self.options.get("cache_size"), prefetch=bool(self.options.get("prefetch", True)),
            prefetch_k=self.options.get("prefetch_k"),
            prefetch_input=_enum_value(self.options.get("prefetch_input", "residual")), quantize=quantize,
            default_cache_size=int(self.options.get("default_cache_size") or DEFAULT_CACHE_SIZE),
            budget_source=self.budget_source)

    def info(self) -> dict[str, Any]:
        d = super().info()
        d["reimplementation"] = ("Mixtral-Offloading's policy re-implemented in fiddler's engine (the original, "
                                 "dvmazur/mixtral-offloading, is a research repository, not a package)")
        return d


__all__ = ["MixtralOffloadingAdapter", "SystemUnavailable"]
