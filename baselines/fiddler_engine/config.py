"""Options of `system=fiddler` (conf/system/fiddler.yaml)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from baselines.engine_config import EngineSystemConfig


class Planner(Enum):
    paper = "paper"
    makespan = "makespan"


class Placement(Enum):
    popularity = "popularity"
    random = "random"


@dataclass
class FiddlerConfig(EngineSystemConfig):
    schema_name = "fiddler_schema"

    planner: Planner = Planner.makespan
    placement: Placement = Placement.popularity
    popularity_profile: Optional[str] = None  # JSON profile; None = the model's reference profile, else uniform
    overlap: Optional[bool] = None  # CPU and GPU queues concurrently; None = the executor's default (ablation: false)

    def sim_policy(self):
        from fiddler.sim import FiddlerSimPolicy

        return FiddlerSimPolicy(planner=self.planner.value, placement=self.placement.value,
                                overlap=self.overlap is not False)
