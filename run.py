"""Benchmark entry point: `python run.py system=fiddler workload=beam` (see README)."""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import runners  # noqa: F401  (registers the structured configs and the ${detect:} resolver)
from runners.main import failures, run_job
from runners.schema import ConfigError

_failed_jobs: list[str] = []


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        recs = run_job(cfg, run_dir)
    except (ConfigError, FileNotFoundError) as exc:
        # a bad configuration: one line naming the problem, before anything ran
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    bad = failures(recs)
    if bad:
        _failed_jobs.append(hc.job.override_dirname or "job")
        print(f"{len(bad)} configuration(s) failed; see {run_dir / 'records.jsonl'}", file=sys.stderr)


if __name__ == "__main__":
    main()
    sys.exit(1 if _failed_jobs else 0)
