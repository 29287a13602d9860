"""`python run.py` in a subprocess: the README's commands, sweeps with a combined table, start-up
errors, and SIGTERM in the middle of a sweep.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runners.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
FAKE = "system.adapter=tests.fake_systems:FakeSystem"


def run_py(*args: str, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def test_beam_run_with_transformers_writes_ok_records(tmp_path):
    """The acceptance command of the harness issue, on the default (generated) model."""
    d = tmp_path / "D"
    res = run_py("system=hf_transformers", "workload=beam", "workload.beam_widths=[2]", f"hydra.run.dir={d}",
                 f"run.index_path={tmp_path / 'index.jsonl'}")
    assert res.returncode == 0, res.stderr[-3000:]
    recs = read_jsonl(d / "records.jsonl", strict=True)
    assert recs and all(r["status"] == "ok" and r["metrics"]["e2e_tok_s"] > 0 for r in recs)
    assert recs[0]["system_info"]["experts_implementation"] in ("grouped_mm", "eager")
    assert recs[0]["system_info"]["transformers"]
    assert "| hf_transformers" in res.stdout and (d / "table.md").exists() and (d / "table.csv").exists()
    # without CUDA every record states its decode bound over the limit environment=local measured
    import torch

    if not torch.cuda.is_available():
        b = recs[0]["decode_bound"]
        env_bw = recs[0]["config"]["environment"]["cpu"]["mem_bandwidth_gbps"]
        assert round(b["limit_gbps"], 1) == round(env_bw, 1) and b["limit_by"] in b["limit_strategies"]
        assert 0 < b["fraction"]["best"] and b["bound_tok_s"] > 0 and "best decode / bound" in res.stdout


@pytest.mark.parametrize("args, first_line", [
    (["workload=beam", "workload.beam_widths=[0]"], "workload.beam_widths"),
    (["system=no_such_system"], "Could not find 'system/no_such_system'"),
    (["model.path=/no/such/checkpoint"], "model.path='/no/such/checkpoint' does not exist"),
])
def test_bad_input_fails_at_start_with_a_one_line_reason(tmp_path, args, first_line):
    res = run_py(*args, f"hydra.run.dir={tmp_path}", f"run.index_path={tmp_path / 'index.jsonl'}", timeout=300)
    assert res.returncode != 0
    assert first_line in res.stderr.strip().splitlines()[0]
    assert not (tmp_path / "index.jsonl").exists()  # nothing ran, nothing recorded


def test_failure_after_start_leaves_an_error_record_and_nonzero_exit(tmp_path):
    res = run_py(FAKE, "workload.input_lens=[8,11]", "workload.output_lens=[4]", "workload.repetitions=1",
                 f"hydra.run.dir={tmp_path / 'D'}", f"run.index_path={tmp_path / 'index.jsonl'}", timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    statuses = {r["point"]["input_len"]: r["status"] for r in read_jsonl(tmp_path / "D" / "records.jsonl")}
    assert statuses == {8: "ok", 11: "error"}


def test_multirun_prints_one_combined_table(tmp_path):
    res = run_py("-m", FAKE, "workload=single_batch,beam", "workload.input_lens=[8]", "workload.output_lens=[4]",
                 "workload.beam_widths=[1]", "workload.repetitions=1", f"hydra.sweep.dir={tmp_path}",
                 f"run.index_path={tmp_path / 'index.jsonl'}", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    combined = (tmp_path / "table.md").read_text()
    assert "| single_batch" in combined and "| beam" in combined
    assert "Combined table (2 rows" in res.stdout


@pytest.mark.realtime
def test_sigterm_mid_sweep_keeps_the_index_whole(tmp_path):
    index = tmp_path / "index.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "run.py", "-m", FAKE, "workload=single_batch,beam", "workload.input_lens=[15,16,17,18]",
         "workload.output_lens=[4]", "workload.beam_widths=[1]", "workload.repetitions=1", "workload.warmup=0",
         f"hydra.sweep.dir={tmp_path / 'sweep'}", f"run.index_path={index}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(read_jsonl(index)) < 2:
        time.sleep(0.2)
    assert len(read_jsonl(index)) >= 2, "sweep produced no records"
    proc.send_signal(signal.SIGTERM)
    t = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t < 30  # exits promptly
    assert proc.returncode != 0
    lines = index.read_text().splitlines()
    recs = [json.loads(line) for line in lines]  # every line is valid JSON
    assert len(recs) < 8  # the sweep did not finish
    assert {r["status"] for r in recs} <= {"ok", "interrupted"}
    ok = [r for r in recs if r["status"] == "ok"]
    assert all(r["metrics"]["valid"] for r in ok)
    # the configuration that was running is recorded as interrupted, never as ok
    interrupted = [r for r in recs if r["status"] == "interrupted"]
    assert len(interrupted) <= 1
    if interrupted:
        key = (interrupted[0]["workload"], interrupted[0]["point"]["input_len"])
        assert key not in {(r["workload"], r["point"]["input_len"]) for r in ok}


def test_joblib_launcher_runs_jobs_that_start_child_processes(tmp_path):
    """README's `python run.py -m hydra/launcher=joblib hydra.launcher.n_jobs=2 ...`: two configurations
    per job put each job's measurement in a child process, started inside a joblib worker."""
    index = tmp_path / "index.jsonl"
    res = run_py("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", FAKE, "workload=single_batch,beam",
                 "workload.input_lens=[8,9]", "workload.output_lens=[4]", "workload.beam_widths=[1]",
                 "workload.repetitions=1", "workload.warmup=0", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                 f"run.index_path={index}", timeout=600)
    recs = read_jsonl(index)
    assert [r["status"] for r in recs] == ["ok"] * 4, [r.get("reason") for r in recs]
    assert {r["method"]["isolation"] for r in recs} == {"process"} and res.returncode == 0, res.stderr[-2000:]
