"""Sweeps over systems compose: a `system.<key>` override on the command line reaches each job's own
system (not the default one Hydra composes the sweep's primary config with), and a job whose system
lacks the key is refused at its start while the other jobs run (README "One bad job does not stop a
sweep"). `python run.py` in a subprocess, on tiny_mixtral with tiny lengths."""
from __future__ import annotations

import pytest

from runners.hardware import measured_cpu_bandwidth
from runners.records import read_records
from tests.test_cli import run_py

TINY = ["model=tiny_mixtral", "workload.input_lens=[8]", "workload.output_lens=[4]"]


@pytest.fixture(scope="module", autouse=True)
def one_read_limit_probe():
    """environment=local's bandwidth probe once here, not in every run.py: they inherit it (runners.hardware)."""
    measured_cpu_bandwidth()


def _sweep(tmp_path, *args: str):
    res = run_py("-m", *args, *TINY, f"hydra.sweep.dir={tmp_path / 's'}", f"run.index_path={tmp_path / 'i.jsonl'}",
                 "run.progress=false", timeout=600)
    return res, read_records(tmp_path / "i.jsonl")


@pytest.mark.llamacpp
def test_a_key_of_every_swept_system_reaches_each_job(tmp_path):
    pytest.importorskip("llama_cpp")
    res, recs = _sweep(tmp_path, "system=fiddler,llama_cpp", "system.quant=q4_0")
    if any("converter is not available" in (r.get("reason") or "") for r in recs):
        pytest.skip("llama.cpp's converter is not available (offline, none cached)")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted((r["system"], r["status"], r["config"]["system"]["quant"]) for r in recs) == [
        ("fiddler", "ok", "q4_0"), ("llama_cpp", "ok", "q4_0")]


def test_a_job_whose_system_lacks_the_key_is_refused_and_the_others_run(tmp_path):
    res, recs = _sweep(tmp_path, "system=fiddler,hf_transformers", "system.quant=q4_0")
    assert res.returncode == 1, res.stderr[-3000:]
    assert [(r["system"], r["status"]) for r in recs] == [("fiddler", "ok")]
    assert not (tmp_path / "s" / "0" / "job_error.txt").exists()
    error = (tmp_path / "s" / "1" / "job_error.txt").read_text()
    assert error.startswith("system.quant is not a known key") and "experts_implementation" in error
    assert "job 1 did not run: system.quant" in res.stderr


def test_a_single_run_with_a_key_its_system_lacks_exits_2_naming_the_key_and_the_valid_ones(tmp_path):
    res = run_py("system=hf_transformers", "system.quant=q4_0", *TINY, f"hydra.run.dir={tmp_path / 'r'}",
                 f"run.index_path={tmp_path / 'i.jsonl'}", timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    first = res.stderr.strip().splitlines()[0]
    assert first.startswith("error: system.quant is not a known key")
    assert all(k in first for k in ("hf_transformers", "name", "adapter", "experts_implementation")), first
    assert not (tmp_path / "i.jsonl").exists()


def test_a_wrong_type_for_a_key_a_swept_system_has_stops_the_sweep_before_any_job(tmp_path):
    """Keys are lenient at composition, types are not: Hydra refuses the llama_cpp job's n_batch=abc while
    it composes every job, before the fiddler job (which lacks the key) would run."""
    res, recs = _sweep(tmp_path, "system=fiddler,llama_cpp", "system.n_batch=abc")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "system.n_batch" in res.stderr and "LlamaCppConfig" in res.stderr and "Traceback" not in res.stderr
    assert recs == [] and not list((tmp_path / "s").glob("*/job_error.txt"))
