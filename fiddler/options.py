"""Fiddler's engine options, written once: the server's command line (`python -m fiddler.server`) adds its
flags from this table, and the harness (systems/fiddler/config.py) takes its choices from it and derives the
server's command line with `command_line`. Torch-free, so a config class can import it.

Each option's name is the keyword of `FiddlerPolicy` / `Engine.from_pretrained` it feeds.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional

PLANNERS = ("paper", "makespan")  # fiddler.planner: the paper's Algorithm 1, the project's makespan rule
PLACEMENTS = ("popularity", "random")  # the harness's two; the server also takes fiddler.placement's others
QUANTS = ("q8_0", "q4_0")  # llama.cpp blocks for experts and attention projections (fiddler.quant)
RESIDENCIES = ("static", "lru", "lfu")  # fiddler.residency.POLICIES: how the resident set changes while serving


@dataclass(frozen=True)
class Option:
    name: str
    type: Callable[[str], Any]
    default: Any = None
    choices: Optional[tuple[str, ...]] = None
    help: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def gpu_budget(text: str) -> float | str:
    """--gpu-budget-gb's type: GiB or auto (fiddler.gpu_budget)."""
    from .gpu_budget import parse_requested

    try:
        return parse_requested(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


OPTIONS = (
    Option("gpu_budget_gb", gpu_budget,
           help="GPU memory for the engine in GiB, or auto (the default): 90%% of the free CUDA memory, and without "
                "CUDA no GPU; 0: no GPU; without CUDA a budget > 0 is emulated on the CPU device"),
    Option("planner", str, "makespan", PLANNERS),
    Option("placement", str, "popularity", help="popularity | random | none | all | fraction:X (fiddler.placement)"),
    Option("popularity", str, help="an expert-popularity JSON for placement=popularity"),
    Option("residency", str, "static", RESIDENCIES,
           help="how the GPU's resident experts change while serving: static (the placement's, for good), lru or "
                "lfu (decayed frequency): fills in the copy engine's idle time (fiddler.residency)"),
    Option("quant", str, None, QUANTS, help="experts and attention as llama.cpp blocks"),
    Option("cpu_threads", int),
)
BY_NAME = {o.name: o for o in OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option as a flag of `parser` (its dest is the option's name)."""
    for o in OPTIONS:
        parser.add_argument(o.flag, type=o.type, default=o.default, choices=o.choices, help=o.help or None)


def command_line(**values: Any) -> list[str]:
    """The flags that give these options their values (None: the server's default)."""
    out: list[str] = []
    for name, value in values.items():
        if value is not None:
            out += [BY_NAME[name].flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return out
