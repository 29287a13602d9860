"""`system=fiddler`: the project's own engine (fiddler/) with Fiddler's executor."""
from __future__ import annotations

from baselines.engine_adapter import EngineAdapter

from .config import FiddlerConfig


class FiddlerAdapter(EngineAdapter):
    config: FiddlerConfig

    def executor_factory(self):
        from fiddler.executors import FiddlerPolicy

        from .profiles import reference_popularity

        c = self.config
        if c.original:
            from baselines.base import SystemUnavailable

            raise SystemUnavailable("system.original=true models the released Fiddler (efeslab/fiddler@227715b) in "
                                    "mode=simulate only; execute mode runs this project's engine")
        # no profile given: the model's real routing statistics where the project has them
        popularity = c.popularity_profile or reference_popularity(self.model.name)
        return FiddlerPolicy(placement=c.placement.value, popularity=popularity, planner=c.planner.value,
                             overlap=c.overlap)
