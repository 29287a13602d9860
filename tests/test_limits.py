"""Limits are enforced or refused: a job that sets run.timeout_s, run.load_timeout_s or
run.memory_limit_gb runs in a child process whatever its number of configurations; out of memory at
any stage is `oom` naming the limit; the system load is timed apart from each configuration."""
from __future__ import annotations

import pytest

from runners.main import prepare
from runners.schema import ConfigError
from tests.test_harness import _job, cfg_of


@pytest.mark.realtime
def test_timeout_is_enforced_for_a_single_configuration(tmp_path):
    """Bug 2: with one configuration the job ran inline and run.timeout_s was silently ignored."""
    recs = _job(tmp_path, "workload.input_lens=[12]", "run.timeout_s=1.5")  # a generate that hangs
    assert [r["status"] for r in recs] == ["timeout"]
    assert recs[0]["reason"] == "configuration exceeded run.timeout_s=1.5"
    assert recs[0]["method"]["isolation"] == "process" and "metrics" not in recs[0]


@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_memory_limit_is_enforced_for_a_single_configuration(tmp_path, isolation):
    """Bug 2 (auto: memory_limit_gb ignored inline), and the misleading `error` for a limit hit while
    loading under process isolation (ImportError: libtorch_cpu.so: failed to map segment)."""
    recs = _job(tmp_path, "workload.input_lens=[8]", "run.memory_limit_gb=0.5", f"run.isolation={isolation}")
    assert [r["status"] for r in recs] == ["oom"]
    # where it runs out (a library, torch, the loader starting a thread) depends on what loads first
    assert "out of memory (run.memory_limit_gb=0.5)" in recs[0]["reason"]


def test_out_of_memory_while_measuring_names_the_limit(tmp_path):
    recs = _job(tmp_path, "workload.input_lens=[13,8]", "run.memory_limit_gb=4", "workload.warmup=0",
                "workload.repetitions=1")
    assert [r["status"] for r in recs] == ["oom", "ok"]
    assert recs[0]["reason"].startswith("out of memory (run.memory_limit_gb=4): MemoryError")


@pytest.mark.parametrize("limit", ["run.timeout_s=5", "run.memory_limit_gb=8", "run.load_timeout_s=5"])
def test_inline_refuses_a_limit_it_cannot_enforce(limit):
    with pytest.raises(ConfigError, match=r"^run.isolation=inline cannot enforce run\."):
        prepare(cfg_of("run.isolation=inline", limit))


@pytest.mark.realtime
def test_load_time_is_recorded_apart_and_not_charged_to_a_configuration(tmp_path, monkeypatch):
    """`run.timeout_s` counted the system load against the first configuration. A load of 12 s
    (a sleep: at least that on any machine) under a 10 s limit per configuration, whose own work is
    instant: a charged load times the first one out."""
    monkeypatch.setenv("FIDDLER_FAKE_LOAD_S", "12")
    recs = _job(tmp_path, "workload.input_lens=[8,9]", "run.timeout_s=10")
    assert [r["status"] for r in recs] == ["ok", "ok"]
    for r in recs:
        assert r["timing"]["load_s"] >= 12 and r["timing"]["measure_s"] is not None


@pytest.mark.realtime
def test_a_load_over_its_limit_fails_every_configuration_once(tmp_path, monkeypatch):
    loads = tmp_path / "loads.txt"
    monkeypatch.setenv("FIDDLER_FAKE_LOAD_LOG", str(loads))
    # the limit covers the child's imports before the system's own load starts (about 3 s here, so 15 s
    # on a machine 5x slower: a CI run under load read past 8 s and the fake load never began); the fake
    # load sleeps far longer than the limit
    monkeypatch.setenv("FIDDLER_FAKE_LOAD_S", "600")
    recs = _job(tmp_path, "workload.input_lens=[8,9,10]", "run.load_timeout_s=30", "run.timeout_s=60")
    assert [r["status"] for r in recs] == ["timeout"] * 3
    assert {r["reason"] for r in recs} == {"loading hf_transformers failed: system load exceeded run.load_timeout_s=30"}
    assert len(loads.read_text().split()) == 1  # one child tried to load, not one per configuration


@pytest.mark.parametrize("exitcode,last_line,status", [
    (-6, "what():  std::bad_alloc", "oom"),  # C++ `new` under RLIMIT_AS aborts: seen in CI while loading
    (127, "error while loading shared libraries: cannot allocate memory for thread-local data", "oom"),
    (-9, "", "oom"),
    (-6, "Assertion `x' failed.", "error"),
    (-11, "", "error"),
    (3, "ValueError: bad", "error"),
])
def test_a_dead_child_is_oom_only_when_it_ran_out_of_memory(exitcode, last_line, status):
    from runners.isolation import _death_reason

    got, reason = _death_reason(exitcode, last_line, 0.5)
    assert got == status
    if status == "oom":
        assert "run.memory_limit_gb=0.5" in reason
    else:
        assert "out of memory" not in reason
