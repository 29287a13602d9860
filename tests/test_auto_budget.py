"""`gpu_budget_gb=auto`: the budget sizes itself by the library's one rule (fiddler.gpu_budget.choose_budget,
90% of a free-memory reading), with the reading injected (a FreeMemory, or $FIDDLER_FAKE_FREE_GPU_BYTES in a
subprocess): in the library, the harness (compose API, execute and simulate records, `python run.py`) and the
server (/health and its start-up log). Without CUDA and without an injected reading, auto is no GPU."""
from __future__ import annotations

import json

import pytest
import torch

from fiddler import gpu_budget
from fiddler.gpu_budget import AUTO, FAKE_FREE_ENV, FreeMemory, choose_budget
from fiddler.gpu_side import EMULATED, NONE, GpuSide
from runners import provenance, schema
from runners.main import prepare, run_job
from systems.base import ConfigError, ModelSpec, RunContext, simulated_budget
from systems.fiddler.adapter import FiddlerAdapter
from systems.fiddler.config import FiddlerConfig
from tests.test_cli import run_py
from tests.test_harness import cfg_of

GIB = 1 << 30
NINETY_OF_10 = int(10 * GIB * 0.9)
NINETY_OF_24 = int(24 * GIB * 0.9)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the meaning of auto without CUDA")


def test_auto_is_90_percent_of_the_reading():
    b = choose_budget(AUTO, FreeMemory(10 * GIB, "free CUDA memory"))
    assert b.bytes == NINETY_OF_10 and b.requested == AUTO
    assert b.source == "auto: 90% of 10.0 GiB free CUDA memory"
    assert b.to_dict() == {"requested": "auto", "bytes": NINETY_OF_10, "source": b.source}
    # the default (no budget given) is the same rule, and a reading may be a function that reads one
    assert choose_budget(None, lambda: FreeMemory(10 * GIB, "free CUDA memory")).bytes == NINETY_OF_10
    # no reading: no GPU, and the record says why
    none = choose_budget(AUTO, None)
    assert none.bytes is None and "no GPU" in none.source
    assert choose_budget(2, None).bytes == 2 * GIB and choose_budget(0.0).bytes is None


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "lots", "3"])
def test_what_is_not_a_budget_is_refused(bad):
    with pytest.raises(ValueError, match="auto"):
        choose_budget(bad, None)


def test_there_is_one_place_for_the_fraction(monkeypatch):
    """Patching the rule's one function moves the library, execute mode's GPU side and mode=simulate."""
    monkeypatch.setattr(gpu_budget, "auto_budget_bytes", lambda free: free // 4)
    assert choose_budget(AUTO, FreeMemory(8 * GIB, "x")).bytes == 2 * GIB
    assert GpuSide.for_budget_gb(AUTO, FreeMemory(8 * GIB, "x")).budget_bytes == 2 * GIB
    assert simulated_budget({"gpu_budget_gb": AUTO}, 24, "rtx4090")[0].bytes == 6 * GIB
    monkeypatch.setenv(FAKE_FREE_ENV, str(8 * GIB))
    side, _ = FiddlerAdapter(FiddlerConfig.build(gpu_budget_gb=AUTO), MODEL, ctx(6.0)).gpu_side()
    assert side.budget_bytes == 2 * GIB


@no_cuda
def test_without_cuda_auto_is_no_gpu_unless_a_reading_is_injected(monkeypatch):
    monkeypatch.delenv(FAKE_FREE_ENV, raising=False)
    side = GpuSide.for_budget_gb(AUTO)
    assert side.kind == NONE and "no CUDA device" in side.chosen.source
    assert GpuSide.default().kind == NONE
    monkeypatch.setenv(FAKE_FREE_ENV, str(10 * GIB))
    side = GpuSide.for_budget_gb(AUTO)
    assert side.kind == EMULATED and side.budget_bytes == NINETY_OF_10
    assert f"${FAKE_FREE_ENV}" in side.chosen.source


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_auto_reads_the_devices_free_memory(monkeypatch):
    monkeypatch.delenv(FAKE_FREE_ENV, raising=False)
    before = torch.cuda.mem_get_info()[0]
    side = GpuSide.for_budget_gb(AUTO)
    after = torch.cuda.mem_get_info()[0]
    assert side.is_cuda and "free CUDA memory" in side.chosen.source
    assert int(min(before, after) * 0.9) <= side.budget_bytes <= int(max(before, after) * 0.9)


# ------------------------------------------------------------------ the harness
MODEL = ModelSpec("tiny_mixtral", "/nonexistent/tiny_mixtral")


def ctx(env_gb: float) -> RunContext:
    return RunContext(threads=2, gpu_memory_gb=env_gb, has_cuda=False, cache_dir="/tmp/unused")


def test_the_harness_takes_auto_and_refuses_other_words():
    conf, _ = prepare(cfg_of("system=fiddler", "system.gpu_budget_gb=auto"))
    assert conf.system.gpu_budget_gb == AUTO and conf.system.gpu_budget(24.0) == (AUTO, "system.gpu_budget_gb")
    conf, _ = prepare(cfg_of("system=mixtral_offloading", "system.gpu_budget_gb=2"))
    assert conf.system.gpu_budget(24.0) == (2.0, "system.gpu_budget_gb")
    with pytest.raises(ConfigError, match=r"system.gpu_budget_gb='lots'.*or auto"):
        prepare(cfg_of("system=fiddler", "system.gpu_budget_gb=lots"))


def test_the_environments_card_memory_stays_a_number_and_says_where_auto_goes():
    assert schema.override_hints(["environment.gpu.memory_gb=auto"]) == [
        "environment.gpu.memory_gb=auto is not a number: it describes the card (GB; 0 = no GPU; environment=local "
        "detects it); a budget that sizes itself is system.gpu_budget_gb=auto (system=fiddler, mixtral_offloading; "
        "docs/harness.md 'The GPU budget')"]
    assert schema.override_hints(["environment.gpu.memory_gb=12"]) == []


def test_simulate_applies_the_rule_to_the_environments_card():
    conf, _ = prepare(cfg_of("mode=simulate", "environment=rtx4090", "system=fiddler", "model=mixtral_8x7b",
                             "system.gpu_budget_gb=auto"))
    budget, key = schema.simulated_gpu_budget(conf)
    assert key == "system.gpu_budget_gb" and budget.bytes == NINETY_OF_24
    assert "90% of 24.0 GiB on environment=rtx4090's card" in budget.source
    # a card of 0 GB (no GPU described): auto is no GPU, and the start checks want no GPU numbers
    conf, _ = prepare(cfg_of("mode=simulate", "environment=rtx4090", "environment.gpu.memory_gb=0",
                             "environment.gpu.bf16_tflops=0", "system=fiddler", "model=mixtral_8x7b",
                             "system.gpu_budget_gb=auto"))
    assert schema.simulated_gpu_budget(conf)[0].bytes is None


def test_execute_mode_builds_the_gpu_side_with_auto(monkeypatch):
    monkeypatch.setenv(FAKE_FREE_ENV, str(10 * GIB))
    side, source = FiddlerAdapter(FiddlerConfig.build(gpu_budget_gb=AUTO), MODEL, ctx(6.0)).gpu_side()
    assert side.budget_bytes == NINETY_OF_10 and side.chosen.requested == AUTO
    assert source.startswith("system.gpu_budget_gb=auto (auto: 90% of 10.0 GiB free GPU memory")
    # the provenance label follows the same rule: on CUDA the card as it is; without, emulated only by the reading
    assert provenance.budget_emulated(_plain(AUTO), None) is True
    assert provenance.budget_emulated(_plain(AUTO), {"memory_gb": 80.0}) is False
    monkeypatch.delenv(FAKE_FREE_ENV)
    if not torch.cuda.is_available():
        side, source = FiddlerAdapter(FiddlerConfig.build(gpu_budget_gb=AUTO), MODEL, ctx(6.0)).gpu_side()
        assert side.kind == NONE and source.startswith("none (system.gpu_budget_gb=auto (auto: no GPU")
        assert provenance.budget_emulated(_plain(AUTO), None) is False


def _plain(gb) -> dict:
    return {"system": {"gpu_budget_gb": gb}, "environment": {"gpu": {"memory_gb": 0.0}}}


SMALL = ("workload.input_lens=[8]", "workload.output_lens=[4]", "workload.repetitions=1", "workload.warmup=0")


@no_cuda
def test_an_execute_record_says_what_auto_chose(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_FREE_ENV, str(10 * GIB))
    (rec,) = run_job(cfg_of("system=fiddler", "system.gpu_budget_gb=auto", "run.progress=false",
                            f"run.index_path={tmp_path / 'index.jsonl'}", *SMALL), tmp_path / "run")
    assert rec["status"] == "ok", rec.get("reason")
    budget = rec["system_info"]["gpu_budget"]
    assert budget["requested"] == AUTO and budget["bytes"] == NINETY_OF_10 and budget["key"] == "system.gpu_budget_gb"
    assert "90% of 10.0 GiB free GPU memory" in budget["source"]
    assert rec["system_info"]["gpu_budget_bytes"] == NINETY_OF_10  # the engine ran with it
    assert rec["environment_info"]["provenance"] == "emulated"


def test_a_simulate_record_says_what_auto_chose(tmp_path):
    """`python run.py ... system.gpu_budget_gb=auto mode=simulate`: 90% of rtx4090's 24 GiB."""
    d = tmp_path / "D"
    res = run_py("mode=simulate", "environment=rtx4090", "system=fiddler", "model=mixtral_8x7b",
                 "system.gpu_budget_gb=auto", "workload.input_lens=[32]", "workload.output_lens=[8]",
                 "run.progress=false", f"hydra.run.dir={d}", f"run.index_path={tmp_path / 'index.jsonl'}",
                 timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
    assert rec["status"] == "ok", rec.get("reason")
    budget = rec["environment_info"]["gpu_budget"]
    assert budget["requested"] == AUTO and budget["bytes"] == NINETY_OF_24 and budget["key"] == "system.gpu_budget_gb"
    assert budget["source"].startswith("auto: 90% of 24.0 GiB on environment=rtx4090's card")
    assert "override" not in budget  # not a sweep beyond or below the card: the rule's share of it
    assert rec["simulation"]["gpu_budget_bytes"] == NINETY_OF_24  # the simulator placed with it


# ------------------------------------------------------------------ the server
def test_the_server_takes_auto_and_says_what_it_chose(monkeypatch):
    from tests.server_helpers import request, running_server

    monkeypatch.setenv(FAKE_FREE_ENV, str(10 * GIB))
    with running_server("--gpu-budget-gb", "auto", "--slots", "2") as (proc, port):
        status, _, health = request(port, "GET", "/health")
        assert status == 200 and health["gpu_budget"]["requested"] == AUTO
        assert health["gpu_budget"]["bytes"] == NINETY_OF_10
        assert health["gpu_budget"]["source"].startswith("auto: 90% of 10.0 GiB free GPU memory")
        status, _, out = request(port, "POST", "/v1/completions",
                                 {"prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
    log = proc.stdout.read()
    side = "cuda" if torch.cuda.is_available() else "cpu (emulated GPU)"
    assert "fiddler.server: GPU budget: auto: 90% of 10.0 GiB free GPU memory" in log
    assert f"-> {NINETY_OF_10} bytes, {side}" in log


def test_the_server_command_line_takes_auto(tmp_path):
    """Also the command the harness derives for serve mode: auto is passed on for the server to apply."""
    from fiddler.server.__main__ import parse_args
    from runners.schema import ServeConfig

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    c = RunContext(threads=2, gpu_memory_gb=6.0, has_cuda=False, cache_dir=str(tmp_path / "cache"))
    cmd = FiddlerAdapter(FiddlerConfig.build(gpu_budget_gb=AUTO), ModelSpec("tiny_mixtral", str(model)),
                         c).server_command(ServeConfig())
    assert parse_args(cmd[3:]).gpu_budget_gb == AUTO
    assert parse_args(["--model", str(model), "--gpu-budget-gb", "1.5"]).gpu_budget_gb == 1.5
    assert parse_args(["--model", str(model)]).gpu_budget_gb is None  # the default: the same rule
    with pytest.raises(SystemExit):
        parse_args(["--model", str(model), "--gpu-budget-gb", "lots"])
