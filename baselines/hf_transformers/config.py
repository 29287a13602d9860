"""Options of `system=hf_transformers` (conf/system/hf_transformers.yaml)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from baselines.base import SystemConfig


class ExpertsImpl(Enum):
    auto = "auto"
    grouped_mm = "grouped_mm"
    batched_mm = "batched_mm"
    eager = "eager"


@dataclass
class HFTransformersConfig(SystemConfig):
    schema_name = "hf_transformers_schema"

    # transformers' MoE experts implementation; auto = the fastest on a CPU (grouped_mm when registered)
    experts_implementation: ExpertsImpl = ExpertsImpl.auto
