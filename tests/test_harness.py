"""The benchmark harness: config composition and validation (Hydra compose API), measurement,
records, resume, isolation of failing configurations, tables. Uses tests/fake_systems.py so that
failures can be provoked without loading a model; the real systems are run through `run.py`
in tests/test_cli.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import runners  # noqa: F401  (registers schemas and resolvers)
from runners import records, tables
from runners.main import prepare, run_job
from runners.schema import ConfigError
from runners.workloads import expand, synthetic_prompt
from systems.registry import system_classes

CONF = Path(__file__).resolve().parents[1] / "conf"
ENVIRONMENTS = sorted(p.stem for p in (CONF / "environment").glob("*.yaml"))
WORKLOADS = sorted(p.stem for p in (CONF / "workload").glob("*.yaml"))
SYSTEMS = sorted(system_classes())  # every system and preset: its config class is its registration
FAKE = "system.adapter=tests.fake_systems:FakeSystem"


def cfg_of(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_groups_have_the_documented_options():
    assert ENVIRONMENTS == ["local", "paper_env1", "paper_env2", "rtx3060", "rtx4090"]
    assert WORKLOADS == ["beam", "long_prefill", "serving", "single_batch"]
    assert {"hf_transformers", "fiddler"} <= set(SYSTEMS)


@pytest.mark.parametrize("environment", ENVIRONMENTS)
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("system", SYSTEMS)
def test_every_combination_composes_and_validates(environment, workload, system):
    conf, resolved = prepare(cfg_of(f"environment={environment}", f"workload={workload}", f"system={system}"))
    # a preset (fiddler_paper, llama_cpp_cpu_moe, ...) is a system with its own name and class
    assert conf.system.name == system and type(conf.system) is system_classes()[system]
    env = resolved["environment"]
    for key in ("name", "memory_gb", "mem_bandwidth_gbps", "bf16_tflops"):
        assert key in env["gpu"]
    assert env["cpu"]["isa"] in ("avx512_bf16", "avx512", "avx2")
    assert env["cpu"]["threads"] == env["cpu"]["cores"]  # default: all cores
    w = conf.workload  # a serving workload's points are per concurrency level, beam 1
    assert len(expand(w)) == len(w.input_lens) * len(w.output_lens) * len(w.concurrency or w.beam_widths)


def test_paper_grids():
    single = prepare(cfg_of("workload=single_batch"))[0].workload
    assert (single.input_lens, single.output_lens, single.beam_widths) == (
        [32, 64, 128, 256], [64, 128, 256, 512], [1])
    beam = prepare(cfg_of("workload=beam"))[0].workload
    assert (beam.input_lens, beam.output_lens, beam.beam_widths) == ([32], [64], [4, 8, 12, 16])
    prefill = prepare(cfg_of("workload=long_prefill"))[0].workload
    assert (prefill.input_lens, prefill.output_lens) == ([512, 1024, 2048, 4096], [1])


def test_described_environments_and_overrides():
    env = prepare(cfg_of("environment=rtx3060"))[0].environment
    assert (env.gpu.memory_gb, env.gpu.mem_bandwidth_gbps) == (12, 360)
    env = prepare(cfg_of("environment=rtx4090", "environment.cpu.threads=4", "environment.gpu.memory_gb=16"))[0]
    assert (env.environment.cpu.threads, env.environment.gpu.memory_gb) == (4, 16)
    assert prepare(cfg_of("environment=paper_env1"))[0].environment.cpu.isa.value == "avx512"


def test_local_environment_without_cuda_has_no_gpu():
    import torch

    env = prepare(cfg_of("environment=local"))[0].environment
    if not torch.cuda.is_available():
        assert env.gpu.memory_gb == 0 and env.gpu.name == "none"
    assert env.cpu.cores >= 1 and env.cpu.mem_bandwidth_gbps > 0


@pytest.mark.parametrize("override, key", [
    ("workload.beam_widths=[0]", "workload.beam_widths"),
    ("workload.input_lens=[]", "workload.input_lens"),
    ("workload.repetitions=0", "workload.repetitions"),
    ("environment.cpu.threads=0", "environment.cpu.threads"),
    ("environment.gpu.memory_gb=-1", "environment.gpu.memory_gb"),
    ("run.timeout_s=0", "run.timeout_s"),
])
def test_out_of_range_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        prepare(cfg_of(override))
    assert str(err.value).startswith(key) and "allowed" in str(err.value)


@pytest.mark.parametrize("overrides, words", [
    (["workload.input_lens=[a]"], ["workload.input_lens"]),
    (["environment.cpu.isa=sse"], ["environment.cpu.isa", "avx512_bf16, avx512, avx2"]),
    (["system=fiddler", "system.planner=greedy"], ["system.planner", "paper, makespan"]),
])
def test_wrong_types_and_enum_values_fail_at_compose(overrides, words):
    with pytest.raises(Exception) as err:
        cfg_of(*overrides)
    text = f"{err.value}\n{err.value.__cause__}"
    assert all(w in text for w in words), text


def test_simulate_mode_is_accepted_and_its_options_checked():
    conf, _ = prepare(cfg_of("mode=simulate", "model=mixtral_8x7b", "environment=rtx3060"))
    assert conf.sim.reuse == 0.26
    with pytest.raises(ConfigError, match="sim.reuse"):
        prepare(cfg_of("mode=simulate", "sim.reuse=1.5"))
    with pytest.raises(ConfigError, match="sim.routing"):
        prepare(cfg_of("mode=simulate", "sim.routing=trace"))


def test_prompts_are_seeded_and_shared():
    a = synthetic_prompt(0, 32, 1024)
    assert a == synthetic_prompt(0, 32, 1024) and len(a) == 32 and a[0] == 1
    assert a != synthetic_prompt(1, 32, 1024)
    assert all(3 <= t < 1024 for t in a[1:])


# ----------------------------------------------------------------- running jobs (fake system)
def _job(tmp_path: Path, *overrides: str, name="run"):
    cfg = cfg_of(FAKE, "workload=beam", "workload.beam_widths=[2]", "workload.output_lens=[4]",
                 "workload.repetitions=2", "workload.warmup=1", f"run.index_path={tmp_path / 'index.jsonl'}",
                 "run.progress=false", *overrides)
    return run_job(cfg, tmp_path / name)


def test_inline_job_writes_records_table_and_index(tmp_path):
    recs = _job(tmp_path, "workload.input_lens=[8,9]", "run.isolation=inline")
    assert [r["status"] for r in recs] == ["ok", "ok"]
    r = recs[0]
    for key in ("schema_version", "run_id", "config_hash", "config", "host", "versions", "code", "method",
                "seeds", "raw", "system_info"):
        assert key in r
    m = r["metrics"]
    assert m["e2e_tok_s"] > 0 and m["ttft_s"] > 0 and m["valid"] and m["repetitions"] == 2
    assert len(r["raw"]["ttft_s"]) == 2 and r["method"]["token_accounting"] == "returned_sequence"
    assert r["host"]["cpu_flags"] and r["versions"]["torch"]
    assert len(records.read_jsonl(tmp_path / "run" / "records.jsonl")) == 2
    assert len(records.read_jsonl(tmp_path / "index.jsonl")) == 2
    assert (tmp_path / "run" / "table.md").read_text().count("| fake") == 0  # system name is the yaml's
    assert "hf_transformers" in (tmp_path / "run" / "table.md").read_text()


@pytest.mark.realtime  # the hang (12) ends at run.timeout_s; instant configurations stay far below it
def test_failing_configurations_are_isolated(tmp_path):
    recs = _job(tmp_path, "workload.input_lens=[8,11,12,13,14,9]", "run.isolation=process",
                "run.timeout_s=10", "run.memory_limit_gb=6", "workload.warmup=0", "workload.repetitions=1")
    by_len = {r["point"]["input_len"]: r for r in recs}
    assert {k: v["status"] for k, v in by_len.items()} == {
        8: "ok", 11: "error", 12: "timeout", 13: "oom", 14: "error", 9: "ok"}
    assert "fake failure" in by_len[11]["reason"]
    assert "SIGSEGV" in by_len[14]["reason"]
    assert "timeout_s" in by_len[12]["reason"]
    assert all("metrics" not in r for r in recs if r["status"] != "ok")
    index = records.read_jsonl(tmp_path / "index.jsonl", strict=True)
    assert len(index) == 6


def test_resume_runs_only_missing_configurations(tmp_path):
    first = _job(tmp_path, "workload.input_lens=[8,9]", "run.isolation=inline", name="a")
    second = _job(tmp_path, "workload.input_lens=[8,9,10]", "run.isolation=inline", name="b")
    assert [r["point"]["input_len"] for r in second] == [8, 9, 10]
    assert [r.get("resumed_from") for r in second[:2]] == [first[0]["run_id"], first[1]["run_id"]]
    assert second[2].get("resumed_from") is None and second[2]["run_id"] != first[0]["run_id"]
    assert len(records.read_jsonl(tmp_path / "index.jsonl")) == 3  # resumed records are not re-appended
    forced = _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline", "run.force=true", name="c")
    assert forced[0].get("resumed_from") is None
    changed = _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline", "workload.seed=5", name="d")
    assert changed[0].get("resumed_from") is None  # a changed config is a new configuration


def test_same_seed_same_tokens_and_hash(tmp_path):
    a = _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline", "run.resume=false", name="a")
    b = _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline", "run.resume=false", name="b")
    assert a[0]["config_hash"] == b[0]["config_hash"] and a[0]["seeds"] == {"workload": 0, "model": 0}
    assert a[0]["stats"] == b[0]["stats"]


def test_damaged_index_line_is_reported_and_skipped(tmp_path, capsys):
    path = tmp_path / "index.jsonl"
    good = {"system": "s", "status": "ok", "point": {"input_len": 1, "output_len": 2, "beam_width": 1},
            "metrics": {"ttft_s": 1.0}, "time": "t"}
    path.write_text(json.dumps(good) + "\n{\"system\": \"trunc\n" + json.dumps(good) + "\n")
    with pytest.warns(UserWarning, match=r"index.jsonl:2: damaged"):
        recs = records.read_jsonl(path)
    assert len(recs) == 2
    with pytest.raises(ValueError, match="index.jsonl:2"):
        records.read_jsonl(path, strict=True)
    table = tables.build(recs)
    assert len(table) == 1 and "1.000" in tables.to_markdown(table)


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    records.atomic_write_text(tmp_path / "f.txt", "a")
    records.atomic_write_text(tmp_path / "f.txt", "b")
    assert (tmp_path / "f.txt").read_text() == "b" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_concurrent_appends_are_whole_lines(tmp_path):
    import multiprocessing as mp

    path = tmp_path / "index.jsonl"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(path, i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    recs = records.read_jsonl(path, strict=True)
    assert len(recs) == 4 * 50 and all(len(r["pad"]) == 5000 for r in recs)


def _append_many(path, worker):
    for i in range(50):
        records.append_lines(Path(path), [{"worker": worker, "i": i, "pad": "x" * 5000}])


def test_tables_keep_rows_that_differ_only_in_an_option():
    def rec(planner, threads, t):
        return {"system": "fiddler", "model": "m", "workload": "w", "environment": "local", "mode": "execute",
                "status": "ok", "time": t, "point": {"input_len": 1, "output_len": 2, "beam_width": 1},
                "config": {"system": {"name": "fiddler", "planner": planner}, "environment": {"cpu": {"threads": threads}},
                           "run": {"force": t == "3"}},
                "metrics": {"ttft_s": 1.0, "repetitions": 3}}

    table = tables.build([rec("paper", 2, "1"), rec("makespan", 2, "2"), rec("makespan", 2, "3")])
    assert sorted(table["variant"]) == ["planner=makespan", "planner=paper"]  # run.* never distinguishes rows
    md = tables.to_markdown(table)
    assert "planner=paper" in md and "variant" in md
    single = tables.build([rec("paper", 2, "1")])
    assert "variant" not in tables.to_markdown(single)


def test_process_env_is_set_in_a_fresh_process(tmp_path):
    import os

    recs = _job(tmp_path, "system.adapter=tests.fake_systems:FakeEnvSystem", "workload.input_lens=[8]")
    assert recs[0]["method"]["isolation"] == "process"  # one configuration, still its own process
    assert recs[0]["stats"]["env"] == "set-before-start"
    assert recs[0]["method"]["process_env"] == {"FIDDLER_FAKE_ENV": "set-before-start"}
    assert "FIDDLER_FAKE_ENV" not in os.environ  # the parent's environment is left as it was
