"""Sweeps beyond one machine: a two-job sweep through `hydra/launcher=submitit_local`, the same submitit
launcher code that `hydra/launcher=submitit_slurm` submits to SLURM with (the `cluster` extra), lands both
jobs' records in one index and prints the combined table. CI (.ci/run, CI=true) installs the extra, so
there the test runs rather than skips."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runners.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def test_a_sweep_through_the_submitit_launcher_lands_in_one_index(tmp_path):
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        if os.environ.get("CI"):
            pytest.fail("hydra-submitit-launcher is missing: scripts/install.sh installs the cluster extra")
        pytest.skip("needs the cluster extra (hydra-submitit-launcher)")
    sweep, index = tmp_path / "sweep", tmp_path / "index.jsonl"
    res = subprocess.run([sys.executable, "run.py", "-m", "hydra/launcher=submitit_local", "mode=simulate",
                          "system=fiddler,fiddler_paper", "model=mixtral_8x7b", "environment=rtx4090",
                          "workload.input_lens=[32]", "workload.output_lens=[8]", "run.progress=false",
                          "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}", f"run.index_path={index}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (sweep / ".submitit").is_dir()  # the jobs went through submitit, not the basic launcher
    recs = read_jsonl(index, strict=True)
    assert sorted((r["system"], r["status"]) for r in recs) == [("fiddler", "ok"), ("fiddler_paper", "ok")]
    assert len({r["run_id"] for r in recs}) == 2  # two jobs, one index
    assert "Combined table (2 rows" in res.stdout
