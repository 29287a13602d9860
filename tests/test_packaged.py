"""The harness as a wheel carries it, outside a checkout: setup.py's build_py output (the packages plus conf/
and results/reference/ as systems/_data/) run from another directory with nothing of the checkout on the
path. --help lists the shipped conf/, and a mode=simulate job of Fiddler on Mixtral-8x7B (its placement
reads the shipped reference popularity profile) writes an ok record under the working directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys; sys.argv[0] = 'fiddler-bench'; from runners.cli import run; run()"  # the console script


@pytest.mark.slow
def test_the_built_packages_run_outside_a_checkout(tmp_path):
    lib, away = tmp_path / "lib", tmp_path / "away"
    away.mkdir()
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    assert (lib / "systems" / "_data" / "conf" / "config.yaml").is_file()
    assert (lib / "systems" / "_data" / "reference" / "paper" / "paper-reported.csv").is_file()
    env = {**os.environ, "PYTHONPATH": str(lib), "PYTHONUNBUFFERED": "1"}
    where = subprocess.run([sys.executable, "-c", "from systems import paths; print(paths.in_checkout(), paths.conf_dir())"],
                           cwd=away, env=env, capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert where == ["False", str(lib / "systems" / "_data" / "conf")]
    help_ = subprocess.run([sys.executable, "-c", CLI, "--help"], cwd=away, env=env, capture_output=True, text=True,
                           timeout=120)
    assert help_.returncode == 0 and "fiddler_original" in help_.stdout and "_schema" not in help_.stdout
    res = subprocess.run([sys.executable, "-c", CLI, "mode=simulate", "system=fiddler", "model=mixtral_8x7b",
                          "environment=rtx4090", "workload.input_lens=[32]", "workload.output_lens=[8]",
                          "run.progress=false"], cwd=away, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = [json.loads(line) for line in (away / "results" / "index.jsonl").read_text().splitlines()]
    assert rec["status"] == "ok" and rec["system"] == "fiddler"
    assert "results/reference/mixtral-8x7b" in json.dumps(rec)  # the placement's profile: the shipped reference
    assert not list(lib.rglob("index.jsonl"))  # nothing written inside the package
