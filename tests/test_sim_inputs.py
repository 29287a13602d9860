"""Inputs that cannot produce wrong numbers (issue 20), mostly in mode=simulate: every number of a config is
checked at start with a one-line ConfigError naming the key (exit 2; in a sweep the job is refused, exit 1),
routing traces are checked at start, simulate refuses what execute refuses, and no record is `ok` with a
NaN or an infinity in it. One test (or case) per item a-l of the probe on 69f45c6."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runners.main import run_job
from runners.records import RunRecords, read_jsonl, read_records
from runners.schema import ConfigError
from tests.test_cli import run_py
from tests.test_harness import cfg_of

SIM = ("mode=simulate", "model=mixtral_8x7b", "environment=rtx3060", "system=fiddler")
SMALL = ("workload.input_lens=[32]", "workload.output_lens=[8]")


def _sim(tmp_path: Path, *overrides: str, name: str = "run") -> list[dict]:
    return run_job(cfg_of(*SIM, *SMALL, "run.progress=false", "run.force=true",
                          f"run.index_path={tmp_path / 'index.jsonl'}", *overrides), tmp_path / name)


def _refused(tmp_path: Path, *overrides: str) -> str:
    """The one-line ConfigError a job refuses with at start; nothing recorded."""
    with pytest.raises(ConfigError) as err:
        _sim(tmp_path, *overrides)
    assert not (tmp_path / "index.jsonl").exists()
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def _trace(path: Path, prefill: int, decode_steps: int, **changes) -> Path:
    """A routing trace of tiny_mixtral's shape (4 layers, 8 experts, top-2)."""
    from fiddler.sim import RoutingTrace

    rng = np.random.default_rng(0)
    steps = [rng.integers(0, 8, size=(4, t, 2)) for t in [prefill] + [1] * decode_steps]
    d = {**RoutingTrace(4, 8, 2, steps, {"made": "test"}).to_dict(), **changes}
    path.write_text(json.dumps(d))
    return path


TINY = ("model=tiny_mixtral", "workload.input_lens=[16]", "workload.output_lens=[8]")


# ---------------------------------------------------------------- tracebacks instead of a one-line error

def test_a_zero_pcie_rate_is_refused_at_start(tmp_path):
    msg = _refused(tmp_path, "environment.pcie.h2d_gbps=0")
    assert msg.startswith("environment.pcie.h2d_gbps=0.0 is invalid; allowed: a finite number > 0 where "
                          "mode=simulate simulates a GPU"), msg


def test_b_an_infinite_gpu_memory_is_refused_at_start(tmp_path):
    msg = _refused(tmp_path, "environment.gpu.memory_gb=inf")
    assert msg.startswith("environment.gpu.memory_gb=inf is invalid; allowed: a finite number >= 0"), msg


def test_c_a_zero_efficiency_factor_is_refused_at_start(tmp_path):
    msg = _refused(tmp_path, "+sim.efficiency.cpu.kernel_bw_fraction=0")
    assert msg.startswith("sim.efficiency.cpu.kernel_bw_fraction=0.0 is invalid; allowed: a number in (0, 1]"), msg


@pytest.mark.parametrize("content, words", [
    ("[1, 2]", "a JSON list, expected an object"),
    (json.dumps({"format": "fiddler.routing_trace", "version": 1, "num_layers": 4, "num_experts": 8, "top_k": 2}),
     "no 'steps'"),
])
def test_d_a_trace_that_is_not_a_trace_object_is_refused_at_start(tmp_path, content, words):
    path = tmp_path / "t.json"
    path.write_text(content)
    msg = _refused(tmp_path, *TINY, f"sim.trace={path}")
    assert msg.startswith(f"sim.trace='{path}': ") and words in msg, msg


@pytest.mark.parametrize("override, allowed", [
    ("environment.gpu.bf16_tflops=0", "a finite number > 0 where mode=simulate simulates a GPU"),
    ("environment.host_memory_gb=inf", "a finite number > 0"),
    ("system.gpu_budget_gb=inf", "null or a finite number >= 0"),
    ("run.timeout_s=inf", "null or a finite number > 0"),
])
def test_e_the_schema_wants_finite_numbers_and_more_than_zero_where_zero_is_meaningless(tmp_path, override,
                                                                                       allowed):
    key, _, value = override.partition("=")
    msg = _refused(tmp_path, override)
    assert msg.startswith(f"{key}={float(value)!r} is invalid; allowed: {allowed}"), msg


def test_e_any_failure_of_the_simulation_setup_is_an_error_record(tmp_path, monkeypatch):
    import runners.simulate

    class Broken:
        def __init__(self, job):
            raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(runners.simulate, "SimSetup", Broken)
    (rec,) = _sim(tmp_path)
    assert rec["status"] == "error"
    assert rec["reason"] == "simulation setup failed: ZeroDivisionError: float division by zero"


# ---------------------------------------------------------------- wrong `ok` records

def _assert_refused_naming_the_key(tmp_path, override: str, allowed: str, as_float: bool = True) -> None:
    """`key=value` is refused at start with the one-line error that names the key, the value (as the
    schema read it) and what is allowed."""
    key, _, value = override.lstrip("+").partition("=")
    msg = _refused(tmp_path, override)
    shown = repr(float(value)) if as_float else value
    assert msg.startswith(f"{key}={shown} is invalid; allowed: {allowed}"), msg



@pytest.mark.parametrize("override, allowed", [
    ("environment.cpu.mem_bandwidth_gbps=inf", "a finite number > 0"),
    ("+sim.efficiency.cpu.kernel_bw_fraction=nan", "a number in (0, 1]"),
])
def test_f_non_finite_cpu_numbers_are_refused_at_start(tmp_path, override, allowed):
    _assert_refused_naming_the_key(tmp_path, override, allowed)


@pytest.mark.parametrize("override, allowed", [
    ("+sim.efficiency.cpu.kernel_bw_fraction=1e9", "a number in (0, 1]"),
    ("+sim.efficiency.gpu.flops_fraction=inf", "a number in (0, 1]"),
    ("environment.gpu.mem_bandwidth_gbps=0", "a finite number > 0 where mode=simulate simulates a GPU"),
])
def test_g_out_of_range_factors_and_a_zero_gpu_bandwidth_are_refused_at_start(tmp_path, override, allowed):
    _assert_refused_naming_the_key(tmp_path, override, allowed)


# ---------------------------------------------------------------- misleading

def test_h_a_zero_d2h_rate_is_refused_not_replaced_by_h2d(tmp_path):
    msg = _refused(tmp_path, "environment.pcie.d2h_gbps=0")
    assert msg.startswith("environment.pcie.d2h_gbps=0.0 is invalid; allowed: a finite number > 0 where "
                          "mode=simulate simulates a GPU"), msg


@pytest.mark.parametrize("key", ["environment.cpu.threads", "system.cpu_threads"])
def test_i_threads_beyond_the_described_cores_are_refused(tmp_path, key):
    msg = _refused(tmp_path, f"{key}=64")
    assert msg.startswith(f"{key}=64 is more than the 6 cores environment=rtx3060 describes; allowed: 1..6"), msg


@pytest.mark.parametrize("override, allowed", [
    ("+sim.efficiency.cpu.kernel_bw_fraction=-0.5", "a number in (0, 1]"),
    ("model.arch.hidden_size=-4096", "an integer >= 1"),
])
def test_j_a_negative_value_is_refused_naming_its_key(tmp_path, override, allowed):
    _assert_refused_naming_the_key(tmp_path, override, allowed, as_float="efficiency" in override)


@pytest.mark.parametrize("make, words", [
    (lambda d: _trace(d / "short.json", prefill=8, decode_steps=3),
     "is shorter than the workload (prefill: 8 tokens for workload.input_lens up to 16; decode: 3 rows for 7)"),
    (lambda d: d / "missing.json", "does not exist"),
])
def test_k_a_short_or_missing_trace_is_refused_at_start(tmp_path, make, words):
    path = make(tmp_path)
    msg = _refused(tmp_path, *TINY, f"sim.trace={path}")
    assert msg.startswith(f"sim.trace='{path}' {words}"), msg
    if "shorter" in words:
        assert "sim.trace_cycle=true" in msg


def test_k_a_cycled_trace_is_named_in_the_record(tmp_path):
    path = _trace(tmp_path / "short.json", prefill=8, decode_steps=3)
    full = _trace(tmp_path / "full.json", prefill=16, decode_steps=7)
    (cycled,) = _sim(tmp_path, *TINY, f"sim.trace={path}", "sim.trace_cycle=true", name="cycled")
    (exact,) = _sim(tmp_path, *TINY, f"sim.trace={full}", name="exact")
    assert cycled["status"] == exact["status"] == "ok", (cycled.get("reason"), exact.get("reason"))
    assert cycled["simulation"]["routing"]["cycled"] == "trace cycled: prefill 8 tokens for 16; decode 3 rows for 7"
    assert exact["simulation"]["routing"]["cycled"] is None


@pytest.mark.parametrize("model, quant", [("tiny_qwen2_moe", "q8_0"), ("deepseek_v3", "q4_0")])
def test_l_simulate_refuses_the_quant_the_engine_refuses_with_its_message(tmp_path, model, quant):
    from fiddler import quant as fquant
    from fiddler.config import UnsupportedModelError
    from runners.simulate import model_config

    with pytest.raises(UnsupportedModelError) as engine:  # what the engine says at load
        fquant.check_attention(model_config(dict(cfg_of(f"model={model}").model.arch)))
    msg = _refused(tmp_path, f"model={model}", f"system.quant={quant}")
    assert msg == f"system.quant={quant!r} is invalid for model={model}: {engine.value}", msg


def test_l_execute_refuses_it_at_start_with_the_same_message(tmp_path):
    from fiddler import quant as fquant
    from runners.simulate import model_config

    with pytest.raises(ValueError) as engine:
        fquant.check_attention(model_config(dict(cfg_of("model=tiny_qwen2_moe").model.arch)))
    with pytest.raises(ConfigError) as err:
        run_job(cfg_of("system=fiddler", "model=tiny_qwen2_moe", "system.quant=q8_0", "workload.input_lens=[8]",
                       "workload.output_lens=[2]", "workload.repetitions=1", "workload.warmup=0",
                       "run.isolation=inline", "run.progress=false", f"run.index_path={tmp_path / 'i.jsonl'}"),
                tmp_path / "run")
    assert str(err.value) == f"system.quant='q8_0' is invalid for model=tiny_qwen2_moe: {engine.value}"
    assert not (tmp_path / "i.jsonl").exists()


# ---------------------------------------------------------------- no record is ok with NaN or inf

def _strict_lines(path: Path) -> list[dict]:
    def refuse(token):
        raise ValueError(f"{path}: {token} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_the_writer_turns_an_ok_record_with_a_non_finite_number_into_an_error(tmp_path):
    rec = {"schema_version": 1, "run_id": "r", "time": "t", "status": "ok", "reason": None, "system": "s",
           "model": "m", "workload": "w", "environment": "e", "mode": "simulate", "config_hash": "h",
           "point": {"input_len": 8, "output_len": 4, "beam_width": 1},
           "metrics": {"ttft_s": 0.5, "prefill_tok_s": 16.0, "e2e_tok_s": 2.0},
           "stats": {"lanes": [1.0, float("nan")], "floor": float("inf")}}
    store = RunRecords(tmp_path / "run", tmp_path / "index.jsonl")
    store.add(rec)
    for path in (tmp_path / "run" / "records.jsonl", tmp_path / "index.jsonl"):
        (saved,) = _strict_lines(path)  # strict JSON: no NaN or Infinity tokens
        assert saved["status"] == "error"
        assert saved["reason"] == ("an ok record must hold finite numbers only: stats.lanes[1]=nan "
                                   "(its metrics are dropped)")
        assert "metrics" not in saved and saved["stats"] == {"lanes": [1.0, None], "floor": None}
    assert store.records[0]["status"] == "error"  # what the job returns (exit 1)


def test_an_ok_record_with_a_non_finite_number_anywhere_is_damaged_on_read(tmp_path):
    good = {"status": "ok", "point": {"input_len": 8, "output_len": 4, "beam_width": 1},
            "metrics": {"ttft_s": 0.5, "prefill_tok_s": 16.0, "e2e_tok_s": 2.0}}
    path = tmp_path / "index.jsonl"
    path.write_text(json.dumps({**good, "system_info": {"gpu_b": float("inf")}}) + "\n" + json.dumps(good) + "\n")
    with pytest.warns(UserWarning, match=r"index.jsonl:1: damaged record line skipped \(an ok record with a "
                                         r"non-finite number: system_info.gpu_b=inf\)"):
        assert len(read_records(path)) == 1


def test_the_record_walk_sees_records_and_none_is_ok_with_a_non_finite_number(tmp_path):
    from tests.conftest import walk_records

    _sim(tmp_path, name="gpu")
    _sim(tmp_path, "environment=local", "environment.cpu.mem_bandwidth_gbps=30", "environment.gpu.memory_gb=0",
         name="cpu")
    seen = walk_records([tmp_path])
    assert (seen.records, seen.ok, seen.files) == (2, 2, 2)
    assert seen.problems == []


# ---------------------------------------------------------------- exit codes through run.py

RUN = (*SIM, *SMALL, "run.progress=false")


def test_run_py_exits_2_with_one_line_naming_the_key(tmp_path):
    res = run_py(*RUN, "environment.pcie.h2d_gbps=0", f"hydra.run.dir={tmp_path / 'r'}",
                 f"run.index_path={tmp_path / 'i.jsonl'}", timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("error: environment.pcie.h2d_gbps=0.0 is invalid; allowed: a finite number > 0")
    assert "Traceback" not in res.stderr and not (tmp_path / "i.jsonl").exists()


def test_a_sweep_refuses_the_job_with_the_bad_value_and_runs_the_others(tmp_path):
    res = run_py("-m", *RUN, "environment.pcie.h2d_gbps=25,0", f"hydra.sweep.dir={tmp_path / 's'}",
                 f"run.index_path={tmp_path / 'i.jsonl'}", timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    assert [r["status"] for r in read_records(tmp_path / "i.jsonl")] == ["ok"]
    assert not (tmp_path / "s" / "0" / "job_error.txt").exists()
    error = (tmp_path / "s" / "1" / "job_error.txt").read_text()
    assert error.startswith("environment.pcie.h2d_gbps=0.0 is invalid; allowed: a finite number > 0"), error
    assert "job 1 did not run: environment.pcie.h2d_gbps=0.0" in res.stderr
    assert read_jsonl(tmp_path / "s" / "0" / "records.jsonl")[0]["status"] == "ok"


# ---------------------------------------------------------------- the efficiency factors' one table

def test_every_efficiency_factor_has_a_range_and_every_class_lies_in_it():
    from dataclasses import fields

    from fiddler.sim.efficiency import CPU_CLASSES, FACTOR_RANGES, GPU_CLASSES, CpuClass, GpuClass

    factors = {f"{part}.{f.name}" for part, cls in (("cpu", CpuClass), ("gpu", GpuClass)) for f in fields(cls)
               if f.type in ("float", float)}
    assert set(FACTOR_RANGES) == factors
    for part, classes in (("cpu", CPU_CLASSES), ("gpu", GPU_CLASSES)):
        for c in classes.values():
            for key in (k for k in FACTOR_RANGES if k.startswith(f"{part}.")):
                assert FACTOR_RANGES[key].contains(getattr(c, key.partition(".")[2])), (c.name, key)


def test_the_library_refuses_an_out_of_range_override_too():
    from fiddler.sim import Efficiency

    eff = Efficiency.for_classes("avx2_desktop")
    assert eff.with_overrides({"gpu.launch_s": 0.0}).gpu.launch_s == 0.0  # a fixed cost may be 0
    with pytest.raises(ValueError, match=r"gpu.bw_fraction=1.5 is out of range; allowed: a number in \(0, 1\]"):
        eff.with_overrides({"gpu.bw_fraction": 1.5})
