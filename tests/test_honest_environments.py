"""An environment that does not describe this host is never executed as if it did.

Execute mode runs `environment=local` (a budget may be emulated on it, and the record says so), or a
described environment whose GPU is this host's CUDA device. Anything else is refused before anything
loads, with one line naming the two ways out; records say measured, emulated or simulated.
"""
from __future__ import annotations

import pytest

from fiddler import hardware
from runners import provenance
from runners.schema import ConfigError
from tests.test_cli import FAKE, run_py
from tests.test_harness import _job

DESCRIBED = ["rtx3060", "rtx4090", "paper_env1", "paper_env2"]


@pytest.fixture
def loads(tmp_path, monkeypatch):
    path = tmp_path / "loads.txt"
    monkeypatch.setenv("FIDDLER_FAKE_LOAD_LOG", str(path))
    return path


def _host_gpu():
    return provenance.host_gpu()


@pytest.mark.parametrize("env", DESCRIBED)
def test_a_described_environment_is_refused_on_another_host(tmp_path, loads, env):
    """Through Hydra's compose API: nothing loads, nothing is recorded, the reason names both ways out."""
    if _host_gpu() and provenance.gpu_key(_host_gpu()["name"]) in env:  # pragma: no cover (that very card)
        pytest.skip("this host has the environment's GPU")
    with pytest.raises(ConfigError) as err:
        _job(tmp_path, "workload.input_lens=[8]", f"environment={env}", "run.isolation=inline")
    msg = str(err.value)
    assert msg.startswith(f"environment={env} describes a ") and "\n" not in msg
    assert "mode=simulate" in msg and "environment=local environment.gpu.memory_gb=" in msg
    assert not loads.exists() and not (tmp_path / "index.jsonl").exists()


def test_a_foreign_environment_never_resumes_an_old_record(tmp_path, loads, monkeypatch):
    """A record of the same config measured on this host (before the rule) is not handed back either:
    the check runs before resume."""
    monkeypatch.setattr(provenance, "host_gpu", lambda: {"name": "NVIDIA GeForce RTX 3060", "memory_gb": 12.0})
    recs = _job(tmp_path, "workload.input_lens=[8]", "environment=rtx3060", "environment.cpu.threads=1",
                "run.isolation=inline")
    assert recs[0]["status"] == "ok"
    monkeypatch.undo()
    if _host_gpu():  # pragma: no cover
        pytest.skip("needs a host without that GPU")
    with pytest.raises(ConfigError, match="environment=rtx3060 describes"):
        _job(tmp_path, "workload.input_lens=[8]", "environment=rtx3060", "environment.cpu.threads=1",
             "run.isolation=inline", name="again")


def test_a_described_environment_runs_where_its_gpu_is_the_hosts(tmp_path, loads, monkeypatch):
    """The GPU matches (as CUDA names it, without the vendor prefix): it runs; the CPU it describes is
    not this one, which the record states instead of refusing it."""
    monkeypatch.setattr(provenance, "host_gpu", lambda: {"name": "NVIDIA GeForce RTX 4090", "memory_gb": 23.6})
    recs = _job(tmp_path, "workload.input_lens=[8]", "environment=rtx4090", "environment.gpu.name='GeForce RTX 4090'",
                f"environment.cpu.threads={hardware.cpu_cores()}", "run.isolation=inline")
    info = recs[0]["environment_info"]
    assert recs[0]["status"] == "ok" and info["gpu_is_hosts"] and info["provenance"] == "measured"
    assert not info["cpu_is_hosts"] and any(m.startswith("cpu.name: the environment says AMD Ryzen 9 7950X")
                                            for m in info["cpu_mismatch"])
    # the ISA the kernels run is this host's, never reported as the environment's
    if hardware.cpu_isa() != "avx512_bf16":
        assert any(m.startswith("cpu.isa:") for m in info["cpu_mismatch"])


def test_threads_beyond_the_hosts_cores_are_refused_for_a_matching_environment(tmp_path, loads, monkeypatch):
    monkeypatch.setattr(provenance, "host_gpu", lambda: {"name": "Quadro RTX 6000", "memory_gb": 24.0})
    if hardware.cpu_cores() >= 12:  # pragma: no cover
        pytest.skip("needs fewer than paper_env1's 12 cores")
    with pytest.raises(ConfigError) as err:
        _job(tmp_path, "workload.input_lens=[8]", "environment=paper_env1", "run.isolation=inline")
    assert str(err.value).startswith("environment.cpu.threads=12 is more than the")
    assert not loads.exists()


def test_local_with_an_emulated_budget_says_emulated(tmp_path, loads):
    if _host_gpu():  # pragma: no cover
        pytest.skip("without CUDA any budget is emulated; with CUDA, see test_provenance_of_budgets")
    recs = _job(tmp_path, "workload.input_lens=[8]", "environment.gpu.memory_gb=12", "run.isolation=inline")
    info = recs[0]["environment_info"]
    assert info["budget_emulated"] and info["provenance"] == "emulated" and info["cpu_is_hosts"]
    plain = _job(tmp_path, "workload.input_lens=[9]", "run.isolation=inline", name="plain")
    assert plain[0]["environment_info"]["provenance"] == "measured"


def test_local_with_another_gpu_name_is_refused(tmp_path, loads):
    """Overriding local's GPU name claims another card: the same refusal."""
    with pytest.raises(ConfigError, match="environment=local describes a NVIDIA GeForce RTX 3060 GPU"):
        _job(tmp_path, "workload.input_lens=[8]", "environment.gpu.name='NVIDIA GeForce RTX 3060'")


@pytest.mark.parametrize("cuda, budget, expected", [
    (None, 0, False), (None, 12, True),
    ({"name": "H200", "memory_gb": 139.8}, 12, True), ({"name": "H200", "memory_gb": 139.8}, 139.8, False),
])
def test_provenance_of_budgets(cuda, budget, expected):
    config = {"mode": "execute", "environment": {"gpu": {"memory_gb": budget}}, "system": {}}
    assert provenance.budget_emulated(config, cuda) is expected
    # a system's own budget wins over the environment's
    config["system"]["gpu_budget_gb"] = 0
    assert provenance.budget_emulated(config, cuda) is (bool(cuda) and cuda["memory_gb"] > 0.5)
    assert provenance.label("simulate", True) == "simulated"


def test_gpu_names_compare_by_model_not_by_prefix():
    assert provenance.gpu_key("NVIDIA GeForce RTX 4090") == provenance.gpu_key("geforce  rtx 4090")
    assert provenance.gpu_key("Quadro RTX 6000") != provenance.gpu_key("NVIDIA RTX 6000 Ada Generation")
    assert provenance.gpu_is_hosts("none", None) and not provenance.gpu_is_hosts("NVIDIA H200", None)


def test_records_written_before_the_rule_are_labelled_from_what_they_say():
    assert provenance.of_record({"mode": "execute", "environment_info": {"described": True}}) == "emulated"
    assert provenance.of_record({"mode": "simulate"}) == "simulated"
    assert provenance.of_record({"mode": "execute", "environment_info": {}}) == "measured"


@pytest.mark.parametrize("env", ["rtx3060", "paper_env2"])
def test_run_py_refuses_a_foreign_environment_with_exit_2(tmp_path, env):
    """Through `python run.py` in a subprocess: exit 2, one line naming both ways out, nothing written."""
    if _host_gpu():  # pragma: no cover
        pytest.skip("a CUDA host: covered by the compose-API test")
    res = run_py(f"environment={env}", "system=fiddler", FAKE, "workload.input_lens=[8]", "workload.output_lens=[2]",
                 f"hydra.run.dir={tmp_path / 'run'}", f"run.index_path={tmp_path / 'i.jsonl'}", timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: environment={env} describes a ") and len(lines) == 1
    assert "mode=simulate" in lines[0] and "environment=local environment.gpu.memory_gb=" in lines[0]
    assert not (tmp_path / "i.jsonl").exists() and not (tmp_path / "run" / "records.jsonl").exists()


def _rec(system, mode, described=False, emulated=False, tok=1.0):
    return {"system": system, "model": "m", "workload": "w", "environment": "e", "mode": mode, "status": "ok",
            "time": "t", "point": {"input_len": 8, "output_len": 4, "beam_width": 1},
            "host": {"cpu_name": "Test CPU"},
            "metrics": {"e2e_tok_s": tok, "ttft_s": 0.1, "prefill_tok_s": 80.0},
            "environment_info": {"described": described, "budget_emulated": emulated}}


def test_tables_say_what_produced_the_numbers_in_the_header_and_on_every_row(tmp_path):
    import json

    from runners import tables
    from runners.tables import main as tables_main

    recs = [_rec("a", "execute"), _rec("b", "execute", emulated=True), _rec("c", "simulate")]
    md = tables.to_markdown(tables.build(recs))
    head, body = md.split("\n\n", 1)
    assert head.startswith("Numbers: MEASURED: measured on this host (Test CPU) (1 rows); EMULATED:")
    assert "SIMULATED: simulated from the environment's hardware spec" in head
    from tests import md_table

    (table,) = md_table.tables(body)
    col = table[0].index("numbers")  # the rows' labels differ, so each row carries its own
    assert [(r[0], r[col]) for r in table[1:]] == [("a", "measured"), ("b", "emulated"), ("c", "simulated")]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tables_main([str(path), "--out", str(tmp_path / "o")])
    assert (tmp_path / "o" / "table.md").read_text().startswith("Numbers: MEASURED")
    assert list(__import__("pandas").read_csv(tmp_path / "o" / "table.csv")["provenance"]) == \
        ["measured", "emulated", "simulated"]
