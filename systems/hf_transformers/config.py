"""`system=hf_transformers`: the options and their defaults."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from systems.base import SystemConfig


class ExpertsImpl(Enum):
    auto = "auto"
    grouped_mm = "grouped_mm"
    batched_mm = "batched_mm"
    eager = "eager"


@dataclass
class HFTransformersConfig(SystemConfig):
    """Plain transformers generate(): the numerical and performance reference."""

    name: str = "hf_transformers"
    adapter: str = "systems.hf_transformers.adapter:HFTransformersAdapter"
    # transformers' MoE experts implementation; auto = grouped_mm when registered, the fastest on a CPU (ahead
    # of eager; batched_mm is far slower there); the record states the one used
    experts_implementation: ExpertsImpl = ExpertsImpl.auto

    def sim_policy(self):
        from systems.base import SystemUnavailable

        raise SystemUnavailable(
            "hf_transformers has no simulation model: the Fiddler paper does not compare with it, and how "
            "transformers/accelerate would offload a model beyond the GPU (device_map='auto' with CPU-offloaded "
            "modules run on the CPU or streamed per forward) is not modelled; run it in execute mode")
