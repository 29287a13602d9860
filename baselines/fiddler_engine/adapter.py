"""`system=fiddler`: the project's own engine (fiddler/) with Fiddler's executor."""
from __future__ import annotations

from baselines.engine_adapter import EngineAdapter

from .config import FiddlerConfig


class FiddlerAdapter(EngineAdapter):
    config: FiddlerConfig

    def executor_factory(self):
        from fiddler.executors import FiddlerPolicy

        c = self.config
        return FiddlerPolicy(placement=c.placement.value, popularity=c.popularity_profile, planner=c.planner.value)
