"""mode=simulate through the harness (Hydra compose API): every environment, records with execute mode's
metric fields plus the simulation's provenance, determinism, budget overrides labelled."""
from __future__ import annotations

import pytest

from tests.test_harness import ENVIRONMENTS, cfg_of
from runners.main import run_job

SMALL = ("workload.input_lens=[32]", "workload.output_lens=[8]")


def _run(tmp_path, *overrides, name="run"):
    return run_job(cfg_of("mode=simulate", "model=mixtral_8x7b", "run.progress=false",
                          f"run.index_path={tmp_path / 'index.jsonl'}", "run.force=true", *SMALL, *overrides),
                   tmp_path / name)


@pytest.mark.parametrize("environment", [e for e in ENVIRONMENTS if e != "local"])
def test_fiddler_simulates_every_described_environment(tmp_path, environment):
    (rec,) = _run(tmp_path, "system=fiddler", f"environment={environment}")
    assert rec["status"] == "ok", rec.get("reason")
    assert rec["mode"] == "simulate"
    info = rec["environment_info"]
    assert info["simulated"] is True and info["provenance"] == "simulated"
    m = rec["metrics"]
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "e2e_tok_s"):
        assert m[key] > 0
    ex = rec["stats"]["executor"]
    assert 0 < ex["gpu_hit_rate"] < 1
    assert sum(ex["tokens"].values()) == ex["routed_tokens"] == 32 * 32 * 2 + 7 * 32 * 2
    sim = rec["simulation"]
    assert sim["spec"]["environment"] == environment
    assert sim["routing"]["kind"] == "profile" and "mixtral-8x7b" in sim["routing"]["profile"]
    assert sim["routing"]["reuse"] == 0.26
    assert "mixtral-8x7b" in sim["placement_popularity"]
    assert sim["efficiency_sources"]["cpu"]["kernel_bw_fraction"]


def test_simulate_is_deterministic(tmp_path):
    a = _run(tmp_path, "system=fiddler", "environment=rtx4090", name="a")[0]
    b = _run(tmp_path, "system=fiddler", "environment=rtx4090", name="b")[0]
    assert a["metrics"] == b["metrics"] and a["stats"] == b["stats"]


def test_a_budget_beyond_the_card_is_labelled_and_keeps_more_experts_resident(tmp_path):
    card = _run(tmp_path, "system=fiddler", "environment=rtx3060", name="card")[0]
    big = _run(tmp_path, "system=fiddler", "environment=rtx3060", "environment.gpu.memory_gb=100", name="big")[0]
    assert "override" not in card["environment_info"]["gpu_budget"]
    assert big["environment_info"]["gpu_budget"]["override"] == "beyond the card's memory"
    assert big["stats"]["executor"]["gpu_hit_rate"] == 1.0 > card["stats"]["executor"]["gpu_hit_rate"]
    assert big["metrics"]["decode_tok_s"] > card["metrics"]["decode_tok_s"]


def test_reuse_parameter_moves_the_routing(tmp_path):
    a = _run(tmp_path, "system=fiddler", "environment=rtx3060", "sim.reuse=0", name="a")[0]
    b = _run(tmp_path, "system=fiddler", "environment=rtx3060", "sim.reuse=0.9", name="b")[0]
    assert a["simulation"]["routing"]["reuse"] == 0 and b["simulation"]["routing"]["reuse"] == 0.9
    assert a["stats"] != b["stats"]


def test_a_routing_trace_recorded_in_execute_mode_drives_a_simulation(tmp_path):
    from tests.test_harness import cfg_of as compose

    (ex,) = run_job(compose("system=fiddler", "model=tiny_mixtral", "environment=local",
                            "environment.cpu.mem_bandwidth_gbps=20", "system.record_routing=true",
                            "workload.input_lens=[16]", "workload.output_lens=[4]", "workload.repetitions=1",
                            "workload.warmup=0", "run.progress=false", "run.isolation=inline",
                            f"run.index_path={tmp_path / 'index.jsonl'}"), tmp_path / "ex")
    assert ex["status"] == "ok", ex.get("reason")
    path = ex["routing_trace"]
    assert path.startswith(str(tmp_path / "ex" / "routing"))
    from fiddler.sim import RoutingTrace

    trace = RoutingTrace.load(path)
    assert [s.shape[1] for s in trace.steps] == [16, 1, 1, 1]
    (sim,) = run_job(compose("mode=simulate", "system=fiddler", "model=tiny_mixtral", "environment=rtx3060",
                             f"sim.trace={path}", "workload.input_lens=[16]", "workload.output_lens=[4]",
                             "run.progress=false", f"run.index_path={tmp_path / 'index.jsonl'}"), tmp_path / "sim")
    assert sim["status"] == "ok", sim.get("reason")
    assert sim["simulation"]["routing"]["kind"] == "trace" and sim["simulation"]["routing"]["trace"] == path
    assert sim["stats"]["executor"]["routed_tokens"] == (16 + 3) * 4 * 2


def test_local_environment_simulates_this_hosts_cpu_only_spec(tmp_path):
    (rec,) = _run(tmp_path, "system=fiddler", "environment=local", "environment.cpu.mem_bandwidth_gbps=30",
                  "environment.gpu.memory_gb=0")
    assert rec["status"] == "ok", rec.get("reason")
    assert rec["simulation"]["spec"]["cpu_read_limit_source"].startswith("measured")
    assert rec["stats"]["executor"]["tokens"]["c"] == rec["stats"]["executor"]["routed_tokens"]


@pytest.mark.parametrize("system", ["mixtral_offloading", "mixtral_offloading_original", "deepspeed_mii",
                                    "llama_cpp", "llama_cpp_cpu_moe", "fiddler_paper"])
def test_every_baseline_simulates_with_its_own_policy(tmp_path, system):
    (rec,) = _run(tmp_path, f"system={system}", "environment=rtx4090")
    assert rec["status"] == "ok", rec.get("reason")
    assert rec["metrics"]["e2e_tok_s"] > 0 and rec["stats"]["executor"]["routed_tokens"] > 0
    assert rec["system_info"]["policy"]


def test_hf_transformers_is_skipped_with_the_reason(tmp_path):
    (rec,) = _run(tmp_path, "system=hf_transformers", "environment=rtx4090")
    assert rec["status"] == "skipped" and "no simulation model" in rec["reason"]


def test_fastgen_that_does_not_fit_is_skipped(tmp_path):
    (rec,) = _run(tmp_path, "system=deepspeed_mii", "system.engine=mii", "environment=rtx4090")
    assert rec["status"] == "skipped" and "whole model in GPU memory" in rec["reason"]


def test_the_systems_own_thread_count_is_simulated(tmp_path):
    a = _run(tmp_path, "system=fiddler", "environment=rtx3060", name="a")[0]
    b = _run(tmp_path, "system=fiddler", "environment=rtx3060", "system.cpu_threads=1", name="b")[0]
    assert a["simulation"]["spec"]["threads"] == 6 and b["simulation"]["spec"]["threads"] == 1
    assert b["metrics"]["ttft_s"] > a["metrics"]["ttft_s"]


def test_an_efficiency_override_from_the_command_line_is_used_and_recorded(tmp_path):
    base = _run(tmp_path, "system=fiddler", "environment=rtx3060", name="a")[0]
    slow = _run(tmp_path, "system=fiddler", "environment=rtx3060", "+sim.efficiency.cpu.kernel_bw_fraction=0.4",
                name="b")[0]
    assert slow["simulation"]["spec"]["efficiency"]["overrides"] == {"cpu.kernel_bw_fraction": 0.4}
    assert "override" in slow["simulation"]["efficiency_sources"]["cpu"]["kernel_bw_fraction"]
    assert slow["metrics"]["decode_tok_s"] < base["metrics"]["decode_tok_s"]
    from runners.schema import ConfigError

    with pytest.raises(ConfigError, match="sim.efficiency.cpu.nonsense"):
        _run(tmp_path, "system=fiddler", "environment=rtx3060", "+sim.efficiency.cpu.nonsense=1", name="c")
