"""Adding a system is one folder and one class: a toy system (a config class and an adapter) written into a
temporary folder, found through FIDDLER_SYSTEMS (systems/registry.py), runs in execute mode and in
mode=simulate with `ok` records, and no file of the repository changes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = '''
from dataclasses import dataclass

from systems.base import SystemConfig, check


@dataclass
class ToyConfig(SystemConfig):
    """A toy system: tokens from the prompt's sum, no model."""

    label = "Toy"
    name: str = "toy"
    adapter: str = "toy_system.adapter:ToyAdapter"
    step: int = 1  # added to each next token

    def __post_init__(self) -> None:
        check(lambda: self.step >= 1, "system.step", self.step, "an integer >= 1")

    def sim_policy(self):  # simulated as Fiddler's decisions: a toy needs a policy, not a new cost model
        from fiddler.sim import FiddlerSimPolicy

        return FiddlerSimPolicy(planner="makespan", placement="popularity", overlap=True, quant=None)
'''

ADAPTER = '''
from systems.base import GenerationResult, SystemAdapter


class ToyAdapter(SystemAdapter):
    def load(self) -> None:
        pass

    def generate(self, request, on_first_token):
        on_first_token()
        first = sum(request.input_ids) % 97
        return GenerationResult(tokens=[(first + i * self.config.step) % 97 for i in range(request.max_new_tokens)])
'''


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def _run(tmp_path: Path, name: str, *args: str) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FIDDLER_SYSTEMS": str(tmp_path / "plugins")}
    res = subprocess.run([sys.executable, "run.py", "system=toy", "system.step=2", "workload.input_lens=[8]",
                          "workload.output_lens=[4]", "workload.repetitions=1", "workload.warmup=0", *args,
                          f"hydra.run.dir={tmp_path / name}", f"run.index_path={tmp_path / 'index.jsonl'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / name / "records.jsonl").read_text().splitlines()]


def test_a_toy_system_in_a_temporary_folder_runs_in_both_modes(tmp_path):
    package = tmp_path / "plugins" / "toy_system"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text(CONFIG)
    (package / "adapter.py").write_text(ADAPTER)
    before = _git_status()

    (rec,) = _run(tmp_path, "execute", "run.isolation=process")  # the spawned child imports the toy too
    assert rec["status"] == "ok", rec["reason"]
    assert rec["system"] == "toy" and rec["config"]["system"]["step"] == 2 and rec["metrics"]["e2e_tok_s"] > 0
    assert rec["config"]["system"]["adapter"] == "toy_system.adapter:ToyAdapter"

    (sim,) = _run(tmp_path, "simulate", "mode=simulate", "model=mixtral_8x7b", "environment=paper_env1")
    assert sim["status"] == "ok", sim["reason"]
    assert sim["system"] == "toy" and sim["mode"] == "simulate" and sim["metrics"]["e2e_tok_s"] > 0

    assert _git_status() == before  # nothing in the repository had to change


def test_a_bad_value_of_the_toy_is_refused_by_its_own_check(tmp_path):
    package = tmp_path / "plugins" / "toy_system"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text(CONFIG)
    (package / "adapter.py").write_text(ADAPTER)
    env = {**os.environ, "FIDDLER_SYSTEMS": str(tmp_path / "plugins")}
    res = subprocess.run([sys.executable, "run.py", "system=toy", "system.step=0", f"hydra.run.dir={tmp_path / 'r'}",
                          f"run.index_path={tmp_path / 'i.jsonl'}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 2 and "system.step=0 is invalid" in res.stderr, res.stderr[-2000:]


def test_the_paper_experiments_rows_and_labels_are_the_config_classes():
    """The paper experiments sweep `${paper_systems:}` and runners/paper.py labels its rows from the classes:
    no list of systems to keep in step with them."""
    from runners import paper, schema
    from systems.registry import system_classes

    classes = system_classes()
    swept = schema.paper_systems().split(",")
    assert swept == [s for s in paper.SYSTEMS if s not in paper.PREFIX_ROWS]
    assert [classes[s].paper_row for s in swept] == sorted(classes[s].paper_row for s in swept)
    for s in swept:
        assert paper.SYSTEMS[s].removesuffix(" †") == classes[s].row_label()
        assert (s in paper.NOT_IN_PAPER) == (classes[s].paper_name is None)
    for experiment in ("paper_single_batch", "paper_long_prefill", "paper_beam"):
        text = (ROOT / "conf" / "experiment" / f"{experiment}.yaml").read_text()
        assert "system: ${paper_systems:}" in text
