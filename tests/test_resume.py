"""Resume keys on what the user asked for, not on what was measured at start; a job with nothing
left to do detects nothing and loads no model."""
from __future__ import annotations

import itertools
import os

import pytest

from fiddler import hardware
from runners import records
from runners.hardware import _FACTS
from tests.test_harness import _job


@pytest.fixture
def varying_probe(monkeypatch):
    """Every start measures a different bandwidth and core count, like a busy host (7.1-15.3 GB/s seen)."""
    bandwidths = itertools.cycle([7.1, 15.3])
    cores = itertools.cycle([1, hardware.cpu_cores()])
    calls = []

    def probe():
        calls.append(1)
        return next(bandwidths)

    monkeypatch.setitem(_FACTS, "cpu.mem_bandwidth_gbps", probe)
    monkeypatch.setitem(_FACTS, "cpu.cores", lambda: next(cores))
    return calls


def test_resume_skips_when_the_measured_environment_differs(tmp_path, varying_probe):
    """Bug 1: the measured bandwidth was part of the config hash, so resume never skipped under the
    default environment=local."""
    first = _job(tmp_path, "workload.input_lens=[8,9]", "run.isolation=inline", name="a")
    second = _job(tmp_path, "workload.input_lens=[8,9]", "run.isolation=inline", name="b")
    assert [r.get("resumed_from") for r in second] == [first[0]["run_id"], first[1]["run_id"]]
    assert len(records.read_records(tmp_path / "index.jsonl")) == 2
    # the measured facts are in the record, not in the hash
    assert first[0]["environment_info"]["detected"]["environment.cpu.mem_bandwidth_gbps"] == 7.1
    assert first[0]["config"]["environment"]["cpu"]["mem_bandwidth_gbps"] == 7.1
    assert first[0]["environment_info"]["detected"]["environment.cpu.cores"] == 1
    # an explicit value is what the user asked for: part of the hash
    pinned = _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline",
                  "environment.cpu.mem_bandwidth_gbps=14", name="c")
    assert pinned[0].get("resumed_from") is None and "environment.cpu.mem_bandwidth_gbps" not in \
        pinned[0]["environment_info"]["detected"]


@pytest.mark.parametrize("isolation", ["inline", "auto"])
def test_a_job_with_nothing_left_loads_no_model(tmp_path, monkeypatch, varying_probe, isolation):
    """A resumed job that skips everything neither probes the host nor loads the system."""
    loads = tmp_path / "loads.txt"
    monkeypatch.setenv("FIDDLER_FAKE_LOAD_LOG", str(loads))
    _job(tmp_path, "workload.input_lens=[8,9]", f"run.isolation={isolation}", name="a")
    assert len(loads.read_text().split()) == 1 and len(varying_probe) == 1
    second = _job(tmp_path, "workload.input_lens=[8,9]", f"run.isolation={isolation}", name="b")
    assert [r["status"] for r in second] == ["ok", "ok"] and all(r["resumed_from"] for r in second)
    assert len(loads.read_text().split()) == 1 and len(varying_probe) == 1
    from tests import md_table

    rows = md_table.dicts((tmp_path / "b" / "table.md").read_text())  # the resumed rows are in the table
    assert [(r["system"], r["input"]) for r in rows] == [("hf_transformers", "8"), ("hf_transformers", "9")]


def test_records_of_other_code_are_not_resumed_and_resume_says_why(tmp_path, monkeypatch, capsys, varying_probe):
    """A config hash includes the code's commit: a sweep recorded before a move of the code (or any commit)
    is measured again, and resume says which records it did not use and why."""
    first = _job(tmp_path, "workload.input_lens=[8,9]", "run.isolation=inline", name="a")
    before = records.code_version()["version"]
    monkeypatch.setattr(records, "code_version", lambda: {"version": "after-the-move", "commit": None, "dirty": None})
    capsys.readouterr()
    second = _job(tmp_path, "workload.input_lens=[8,9]", "run.isolation=inline", name="b")
    assert [r.get("resumed_from") for r in second] == [None, None] and first[0]["code"]["version"] == before
    err = capsys.readouterr().err
    assert f"resume: not resumed: ok records of these configurations from other code (2 at {before})" in err
    assert "config_hash" in err
    third = _job(tmp_path, "workload.input_lens=[8,9]", "run.isolation=inline", name="c")  # the same code: resumed
    assert [r.get("resumed_from") for r in third] == [second[0]["run_id"], second[1]["run_id"]]
    assert "not resumed" not in capsys.readouterr().err


def test_a_forced_kernel_path_is_another_configuration(tmp_path, monkeypatch, varying_probe):
    """FIDDLER_KERNEL_ISA=avx2 (any FIDDLER_KERNEL_* override) measures another kernel path: its run must not
    resume the records of a run without it, nor they its records; unset, the hashes are those of before."""
    config, point = {"workload": {"name": "w"}, "system": {"name": "fiddler"}}, {"input": 8}
    for k in [k for k in os.environ if k.startswith("FIDDLER_KERNEL_")]:
        monkeypatch.delenv(k)
    plain = records.config_hash(config, point)
    monkeypatch.setenv("FIDDLER_KERNEL_ISA", "avx2")
    forced = records.config_hash(config, point)
    monkeypatch.setenv("FIDDLER_KERNEL_ISA", "generic")
    assert len({plain, forced, records.config_hash(config, point)}) == 3
    monkeypatch.delenv("FIDDLER_KERNEL_ISA")
    assert records.config_hash(config, point) == plain
    first = _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline", name="a")
    monkeypatch.setenv("FIDDLER_KERNEL_STREAM", "t0:1024")
    second = _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline", name="b")
    assert first[0]["status"] == second[0]["status"] == "ok" and second[0].get("resumed_from") is None
