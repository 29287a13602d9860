"""Hydra callback: after a multirun (`-m`), one combined table over every job of the sweep that ran,
the jobs that did not run, and the sweep's exit status.

Both come from the sweep directory (records.jsonl and job_error.txt of each job), so they hold for
any launcher, also when jobs run in other processes.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runners import tables
from runners.main import failures
from runners.records import atomic_write_text, collect

JOB_ERROR = "job_error.txt"

# set at the end of a sweep: 0 all ok, 1 something failed, 2 no job ran (every one was refused)
sweep_exit_code: int | None = None


def mark_job_error(job_dir: Path, message: str) -> None:
    atomic_write_text(Path(job_dir) / JOB_ERROR, message + "\n")


def clear_job_error(job_dir: Path) -> None:
    (Path(job_dir) / JOB_ERROR).unlink(missing_ok=True)  # from an earlier sweep into the same directory


class CombinedTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global sweep_exit_code
        sweep_dir = Path(config.hydra.sweep.dir)
        recs = collect([sweep_dir])
        job_errors = sorted(sweep_dir.glob(f"*/{JOB_ERROR}"), key=lambda p: p.parent.name)
        if recs:
            table = tables.build(recs)
            tables.save(table, sweep_dir)
            print(f"\nCombined table ({len(table)} rows; {sweep_dir}/table.md):")
            print(tables.to_markdown(table))
        for path in job_errors:
            print(f"job {path.parent.name} did not run: {path.read_text(errors='replace').strip()}", file=sys.stderr)
        sweep_exit_code = 2 if job_errors and not recs else 1 if job_errors or failures(recs) else 0
