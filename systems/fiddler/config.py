"""`system=fiddler` and its presets `fiddler_paper` and `fiddler_original`: the options and their defaults."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from fiddler import options as engine_options
from systems.base import ConfigError, check
from systems.engine_config import EngineSystemConfig

# the engine's choices (fiddler/options.py, the table the server's command line is made from too)
Planner = Enum("Planner", {name: name for name in engine_options.PLANNERS}, module=__name__)
PlacementRule = Enum("PlacementRule", {name: name for name in engine_options.PLACEMENTS}, module=__name__)
Residency = Enum("Residency", {name: name for name in engine_options.RESIDENCIES}, module=__name__)


@dataclass
class FiddlerConfig(EngineSystemConfig):
    """The Fiddler engine (fiddler/): popularity placement, calibrated planning, CPU/GPU overlap."""

    label = "Fiddler (makespan planner)"
    paper_row = 5
    paper_role = "fiddler"

    name: str = "fiddler"
    adapter: str = "systems.fiddler.adapter:FiddlerAdapter"
    planner: Planner = Planner.makespan
    placement: PlacementRule = PlacementRule.popularity  # not fiddler.placement.Placement (a placement made)
    # JSON profile (scripts/profile_popularity.py format); None = the model's reference profile
    # (mixtral_8x7b: results/reference/mixtral-8x7b/expert-popularity), else uniform
    popularity_profile: Optional[str] = None
    # how the resident set changes while it runs (fiddler.residency): static (placement's experts for good, the
    # paper's), lru, or lfu (decayed frequency, the adaptive default); `placement` says which experts start resident
    residency: Residency = Residency.static
    overlap: Optional[bool] = None  # CPU and GPU queues concurrently; None = the executor's default (ablation: false)
    # long prompts: stage the next layer's expert copies during a layer call (fiddler.streaming; ablation: false)
    lookahead: bool = True
    # None (the model dtype), q8_0 or q4_0: experts and attention projections as llama.cpp blocks
    # (fiddler.quant), like for like with system=llama_cpp's quant of the same type (quant_policy: pure)
    quant: Optional[str] = None
    # true: the released Fiddler as the paper ran it (efeslab/fiddler@227715b), mode=simulate only
    # (systems/fiddler/original_sim.py); the preset fiddler_original below
    original: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check(lambda: self.quant in (None, *engine_options.QUANTS), "system.quant", self.quant,
              f"null, {' or '.join(engine_options.QUANTS)}")

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

    def popularity(self, model_name: str):
        """system.popularity_profile where given, else the model's reference profile, else None (uniform)."""
        from .profiles import placement_popularity

        return placement_popularity(self.popularity_profile, model_name)

    def sim_policy(self):
        if self.original:
            from .original_sim import FiddlerOriginalSimPolicy

            return FiddlerOriginalSimPolicy()
        from fiddler.sim import FiddlerSimPolicy

        return FiddlerSimPolicy(planner=self.planner.value, placement=self.placement.value,
                                overlap=self.overlap is not False, quant=self.quant, residency=self.residency.value,
                                lookahead=self.lookahead)


@dataclass
class FiddlerPaperConfig(FiddlerConfig):
    """Fiddler as the paper ran it: the paper's planning rule (its Algorithm 1) with popularity placement.
    `system=fiddler` is the same engine with the project's makespan planner."""

    label = "Fiddler (paper's rule, our engine)"
    paper_row = 4

    name: str = "fiddler_paper"  # a preset is a system with its own name in records, tables and figures
    planner: Planner = Planner.paper


@dataclass
class FiddlerOriginalConfig(FiddlerConfig):
    """The released Fiddler as the paper ran it (efeslab/fiddler main @227715b, src/fiddler/mixtral.py), for
    mode=simulate. Fixed costs latency_cpu=7 / latency_gpu=70 minimised as a sum, synchronous pageable weight
    copies, a layer's GPU experts then its CPU experts one after the other, CPU experts in PyTorch bf16 on 16
    threads, beam search over the replicated prompt (systems/fiddler/original_sim.py, every choice cited
    there). `system=fiddler_paper` is the paper's rule in this project's engine."""

    label = "Fiddler"
    paper_row = 0
    paper_name = "fiddler"
    today = False

    name: str = "fiddler_original"
    planner: Planner = Planner.paper
    original: bool = True
