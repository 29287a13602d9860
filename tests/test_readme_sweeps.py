"""Every sweep example of the README and docs/ (each `python run.py -m ...`, in a code block or inline) works as
written: every job it expands to, expanded the way Hydra's BasicSweeper does, composes through Hydra
and passes the harness's start-up checks; the cheap ones also run, on tiny models with tiny lengths."""
from __future__ import annotations

import copy
import functools
import re
import shlex
from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import open_dict

import runners  # noqa: F401  (registers the structured configs and the ${detect:} resolver)
from runners import identity, preflight
from runners.main import prepare, run_job
from runners.schema import Mode

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = "..."  # "and your sweep", in the launcher examples


GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def guides_text() -> str:
    return "\n".join(p.read_text() for p in GUIDES)


def readme_sweeps() -> list[list[str]]:
    """The arguments after `python run.py -m` of every sweep example in README.md and docs/."""
    text = guides_text()
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
    commands = [line for block in fence.findall(text) for line in block.replace("\\\n", " ").splitlines()
                if line.lstrip().startswith("python run.py -m ")]
    commands += re.findall(r"`(python run\.py -m [^`]*)`", fence.sub("", text))  # inline, may wrap a line
    return [shlex.split(c, comments=True)[3:] for c in commands]


SWEEPS = readme_sweeps()


def _id(args: list[str]) -> str:
    return " ".join(args)


@functools.lru_cache(maxsize=None)
def sweep_jobs(args: tuple[str, ...]) -> tuple:
    """Each job's config, as `run.py -m ARGS` composes it: the primary config in multirun mode, the sweep
    expanded by BasicSweeper from the config's sweeper params and the task overrides, then every job
    composed from its own overrides (Hydra's validate_batch_is_legal and the launcher do the same)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        primary = loader.load_configuration("config", list(args), run_mode=RunMode.MULTIRUN)
        params = [f"{k}={v}" for k, v in (primary.hydra.sweeper.params or {}).items()]
        overrides = OverridesParser.create(config_loader=loader).parse_overrides(
            params + list(primary.hydra.overrides.task))
        (batch,) = BasicSweeper.split_arguments(overrides, None)
        jobs = []
        for job in batch:
            cfg = loader.load_sweep_config(primary, list(job))
            with open_dict(cfg):
                del cfg["hydra"]  # the task function never sees it
            jobs.append(cfg)
        return tuple(jobs)


def check_job(cfg) -> None:
    """The harness's checks of a job before it loads anything (runners.main.run_job)."""
    preflight.check_execute_environment(identity.requested_config(cfg))
    conf = prepare(cfg)[0]
    if conf.mode is Mode.execute:
        preflight.check_threads(conf)
        assert conf.model.synthetic or conf.model.path, f"model={conf.model.name} cannot execute without a path"


def _jobs(args: list[str]) -> tuple:
    if any("submitit" in a for a in args):
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    return sweep_jobs(tuple(a for a in args if a != PLACEHOLDER))


def test_every_readme_sweep_example_is_found():
    text = guides_text()
    assert len(SWEEPS) == text.count("python run.py -m ") >= 10, SWEEPS
    assert len(CHEAP) >= 2, CHEAP


@pytest.mark.parametrize("args", SWEEPS, ids=_id)
def test_every_job_of_every_readme_sweep_composes_and_passes_the_start_checks(args):
    jobs = _jobs(args)
    assert jobs
    for cfg in jobs:
        check_job(cfg)


# Run in this process as run.py's jobs would (runners.main.run_job), with one tiny workload point: the
# simulate examples, cheap. The paper experiments (28 jobs each; the narrowed one runs in
# tests/test_paper_experiments.py) and the execute examples (their systems run on tiny_mixtral in
# tests/test_sweeps.py and tests/test_cli.py) are only composed and checked here, for time.
CHEAP = [args for args in SWEEPS if "mode=simulate" in args and not any("+experiment" in a for a in args)]


@pytest.mark.parametrize("args", CHEAP, ids=_id)
def test_the_cheap_readme_sweeps_run(args, tmp_path):
    statuses = []
    for num, job in enumerate(_jobs(args)):
        cfg = copy.deepcopy(job)  # the composed jobs are cached for the test above
        cfg.workload.input_lens, cfg.workload.output_lens = [8], [4]
        cfg.run.index_path, cfg.run.progress = str(tmp_path / "index.jsonl"), False
        statuses += [r["status"] for r in run_job(cfg, tmp_path / str(num))]
    assert statuses == ["ok"] * len(_jobs(args))
