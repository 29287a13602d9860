"""Hydra callback: after a multirun (`-m`), one combined table over every job of the sweep."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runners import tables
from runners.records import collect


class CombinedTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        recs = collect([sweep_dir])
        if not recs:
            return
        table = tables.build(recs)
        tables.save(table, sweep_dir)
        print(f"\nCombined table ({len(table)} rows; {sweep_dir}/table.md):")
        print(tables.to_markdown(table))
