"""Hydra callback: after a multirun (`-m`), one combined table over every job of the sweep."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runners import tables
from runners.records import read_jsonl


def sweep_records(sweep_dir: Path) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    for path in sorted(Path(sweep_dir).glob("*/records.jsonl")):
        recs.extend(read_jsonl(path))
    return recs


class CombinedTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        recs = sweep_records(sweep_dir)
        if not recs:
            return
        table = tables.build(recs)
        tables.save(table, sweep_dir)
        print(f"\nCombined table ({len(table)} rows; {sweep_dir}/table.md):")
        print(tables.to_markdown(table))
