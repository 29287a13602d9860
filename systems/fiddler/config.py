"""Options of `system=fiddler` (conf/system/fiddler.yaml)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from systems.base import ConfigError, check
from systems.engine_config import EngineSystemConfig


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
    # None (the model dtype), q8_0 or q4_0: experts and attention projections as llama.cpp blocks
    # (fiddler.quant), like for like with system=llama_cpp's quant of the same type (quant_policy: pure)
    quant: Optional[str] = None
    # true: the released Fiddler as the paper ran it (efeslab/fiddler@227715b), mode=simulate only
    # (systems/fiddler/original_sim.py); conf/system/fiddler_original.yaml
    original: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check(lambda: self.quant in (None, "q8_0", "q4_0"), "system.quant", self.quant, "null, q8_0 or q4_0")

    def check_model(self, model, model_config) -> None:
        """The engine's own refusal at load (fiddler.quant.check_attention), at start, with its message."""
        if self.quant is None:
            return
        from fiddler.quant import check_attention

        try:
            config = model_config()
        except ValueError:
            return  # a model the engine cannot read at all: its load says why
        try:
            check_attention(config)
        except ValueError as exc:
            raise ConfigError(f"system.quant={self.quant!r} is invalid for model={model}: {exc}") from None

    def sim_policy(self):
        if self.original:
            from .original_sim import FiddlerOriginalSimPolicy

            return FiddlerOriginalSimPolicy()
        from fiddler.sim import FiddlerSimPolicy

        return FiddlerSimPolicy(planner=self.planner.value, placement=self.placement.value,
                                overlap=self.overlap is not False, quant=self.quant)
