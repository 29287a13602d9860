"""`system=fiddler`: the project's own engine (fiddler/) with Fiddler's executor."""
from __future__ import annotations

from baselines.engine_adapter import EngineAdapter


class FiddlerAdapter(EngineAdapter):
    def executor_factory(self):
        from fiddler.executors import FiddlerPolicy

        return FiddlerPolicy(placement=self.options.get("placement", "popularity"),
                             popularity=self.options.get("popularity_profile"),
                             planner=self.options.get("planner", "makespan"))
