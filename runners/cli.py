"""The benchmark's command line: `python run.py ...` in a checkout, `fiddler-bench ...` where installed.

Exit status: 0 when every configuration is ok (or skipped); 1 when something failed (a configuration
not ok, or a sweep job that did not run); 2 for a bad configuration, when nothing ran (refused by
the harness's checks or by Hydra's own). `--help` lists the choices (runners/cli_help.py).
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import runners  # noqa: F401  (registers the structured configs and the ${detect:} resolver)
from runners import callbacks
from runners.main import failures, run_job
from runners.schema import ConfigError
from systems import paths

_state = {"started": False, "failed": False}


@hydra.main(version_base="1.3", config_path=str(paths.conf_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    _state["started"] = True
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sweep = hc.mode == RunMode.MULTIRUN
    callbacks.clear_job_error(run_dir)
    if getattr(cfg.get("mode"), "value", cfg.get("mode")) == "serve":  # one server until SIGTERM, no measurement (runners/serving/serve.py)
        if sweep:
            print("error: mode=serve starts one server; it takes no -m sweep", file=sys.stderr)
            sys.exit(2)
        from runners.serving.serve import serve

        try:
            sys.exit(serve(cfg, run_dir))
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
    try:
        recs = run_job(cfg, run_dir)
    except ConfigError as exc:
        # a bad configuration: one line naming the problem, before anything ran
        print(f"error: {exc}", file=sys.stderr)
        if not sweep:
            sys.exit(2)
        callbacks.mark_job_error(run_dir, str(exc))  # the other jobs still run; the summary counts it
        return
    except Exception as exc:
        if not sweep:
            raise  # Hydra prints it; exit 1
        traceback.print_exc()
        callbacks.mark_job_error(run_dir, f"{type(exc).__name__}: {exc}")
        return
    bad = failures(recs)
    if bad:
        _state["failed"] = True
        print(f"{len(bad)} configuration(s) failed; see {run_dir / 'records.jsonl'}", file=sys.stderr)


def run() -> None:
    """`python run.py ...` and the console script `fiddler-bench ...` (pyproject.toml): main() with the exit
    statuses of runners/cli_help.py EXIT_CODES."""
    from runners.serving.api_key import literal_on_command_line

    problem = literal_on_command_line(sys.argv[1:])
    if problem:  # before Hydra writes the overrides down
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        main()
    except SystemExit as exc:
        # Hydra reports its own configuration errors (an unknown group option or key, a string for
        # an int, a scalar for a list; in a sweep it composes every job first) and exits 1 before
        # any job starts: a bad configuration, like the harness's own
        if exc.code == 1 and not _state["started"]:
            # Hydra's advice for a key not in the schema is to add `+` to it: say which key was meant
            from runners.schema import override_hints

            for hint in override_hints(sys.argv[1:]):
                print(f"error: {hint}", file=sys.stderr)
            sys.exit(2)
        raise
    if callbacks.sweep_exit_code is not None:
        sys.exit(callbacks.sweep_exit_code)
    sys.exit(1 if _state["failed"] else 0)
