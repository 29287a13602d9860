"""`python run.py` exit codes and sweeps: Hydra's own configuration errors exit 2 like the harness's;
in a sweep one bad job is reported and the others still run, the combined table covers every job
that ran and the exit code says something failed; the limits' acceptance command; SIGINT while the
system loads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from runners.records import read_records
from tests.test_cli import FAKE, ROOT, run_py

SMALL = ["workload.input_lens=[8]", "workload.output_lens=[4]", "workload.repetitions=1", "workload.warmup=0"]


@pytest.mark.parametrize("override, words", [
    ("workload.repetitions=abc", "workload.repetitions"),  # a string for an int
    ("workload.input_lens=8", "workload.input_lens"),  # a scalar for a list
    ("system=no_such_system", "system/no_such_system"),  # an unknown system
    ("system.foo=1", "system.foo"),  # an unknown key without +
    ("mode=foo", "mode"),  # an unknown enum value
])
def test_hydra_errors_exit_2(tmp_path, override, words):
    """Hydra-level errors exited 1, not the README's 2 for a bad configuration."""
    res = run_py(FAKE, override, f"hydra.run.dir={tmp_path / 'run'}", f"run.index_path={tmp_path / 'i.jsonl'}",
                 timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert words in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "i.jsonl").exists()


@pytest.mark.parametrize("threads, bad_job", [("1,0", "1"), ("0,1", "0")])
def test_one_bad_job_in_a_sweep_is_reported_and_the_rest_run(tmp_path, threads, bad_job):
    """`-m environment.cpu.threads=1,0` exited 2 ("nothing ran") after job 0 wrote an ok record, with
    no combined table; in the order 0,1 the valid job never ran."""
    res = run_py("-m", FAKE, f"environment.cpu.threads={threads}", *SMALL, f"hydra.sweep.dir={tmp_path / 's'}",
                 f"run.index_path={tmp_path / 'i.jsonl'}", timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    assert f"job {bad_job} did not run: environment.cpu.threads=0 is invalid" in res.stderr
    assert [r["status"] for r in read_records(tmp_path / "i.jsonl")] == ["ok"]
    assert "Combined table (1 rows" in res.stdout and "| ok " in (tmp_path / "s" / "table.md").read_text()


def test_a_sweep_where_no_job_runs_exits_2(tmp_path):
    res = run_py("-m", FAKE, "environment.cpu.threads=0,-1", *SMALL, f"hydra.sweep.dir={tmp_path / 's'}",
                 f"run.index_path={tmp_path / 'i.jsonl'}", timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("did not run: environment.cpu.threads=") == 2 and not (tmp_path / "i.jsonl").exists()


@pytest.mark.realtime
def test_timeout_acceptance_command(tmp_path):
    """`P run.timeout_s=1 'workload.input_lens=[8]' 'workload.output_lens=[2000]'` ran 45 s, wrote ok, exit 0.
    The limit here is 0.05 s: the configuration (a warm-up and 3 repetitions of 2000 tokens, 8000 forward
    passes of transformers' generate) cannot finish within it on any machine, where 1 s could on a fast one."""
    res = run_py(f"run.index_path={tmp_path / 'x.jsonl'}", "run.timeout_s=0.05", "workload.input_lens=[8]",
                 "workload.output_lens=[2000]", f"hydra.run.dir={tmp_path / 'run'}", timeout=600)
    assert res.returncode == 1, res.stderr[-2000:]
    recs = read_records(tmp_path / "x.jsonl")
    assert [(r["status"], r["reason"]) for r in recs] == [("timeout", "configuration exceeded run.timeout_s=0.05")]


@pytest.mark.realtime
@pytest.mark.parametrize("inputs", ["[8]", "[8,9]"])  # inline, and a child process
def test_sigint_while_the_system_loads(tmp_path, inputs):
    """SIGINT during system load said the finished records were in a records.jsonl that did not exist."""
    loads = tmp_path / "loads.txt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FIDDLER_FAKE_LOAD_LOG": str(loads), "FIDDLER_FAKE_LOAD_S": "120"}
    proc = subprocess.Popen(
        [sys.executable, "run.py", FAKE, f"workload.input_lens={inputs}", *SMALL[1:], f"hydra.run.dir={tmp_path / 'run'}",
         f"run.index_path={tmp_path / 'i.jsonl'}", "run.progress=false"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    while not loads.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert loads.exists(), "the system never started loading"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "interrupted by SIGINT; no configuration had finished, nothing was recorded"
    assert not (tmp_path / "run" / "records.jsonl").exists() and not (tmp_path / "i.jsonl").exists()
