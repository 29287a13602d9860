"""The GPU budget has one rule on each side: which budget a job asks for is systems.base.gpu_budget (the
system's gpu_budget_gb, else the environment's), and what a budget means is the library's
GpuSide.for_budget_gb (0 = no GPU; without CUDA one > 0 is emulated; auto sized by fiddler.gpu_budget). Patching each rule, every harness path
that reads a budget follows it: execute mode's GPU side, the server's command line, mode=simulate, the start
checks and the provenance label."""
from __future__ import annotations

import pytest

from fiddler import gpu_budget
from fiddler.gpu_budget import Budget
from fiddler.gpu_side import GpuSide
from runners import provenance, schema, simulate
from runners.main import prepare
from systems import base
from systems.base import ModelSpec, RunContext
from systems.fiddler.adapter import FiddlerAdapter
from systems.fiddler.config import FiddlerConfig
from systems.mixtral_offloading.adapter import MixtralOffloadingAdapter
from systems.mixtral_offloading.config import MixtralOffloadingConfig
from tests.test_harness import cfg_of

MODEL = ModelSpec("tiny_mixtral", "/nonexistent/tiny_mixtral")


def ctx(env_gb: float) -> RunContext:
    return RunContext(threads=2, gpu_memory_gb=env_gb, has_cuda=False, cache_dir="/tmp/unused")


def plain(system_gb, env_gb) -> dict:
    return {"system": {"gpu_budget_gb": system_gb}, "environment": {"gpu": {"memory_gb": env_gb}}}


@pytest.mark.parametrize("system_gb, env_gb, want", [(None, 6.0, 6.0), (2.0, 6.0, 2.0), (0.0, 6.0, 0.0),
                                                     (None, 0.0, 0.0), ("auto", 6.0, "auto")])
def test_execute_mode_builds_the_gpu_side_with_the_library_rule(monkeypatch, system_gb, env_gb, want):
    asked = []
    marker = GpuSide.emulated(12345)

    def fake(gb):
        asked.append(gb)
        return marker

    monkeypatch.setattr(GpuSide, "for_budget_gb", staticmethod(fake))
    for adapter, config in ((FiddlerAdapter, FiddlerConfig), (MixtralOffloadingAdapter, MixtralOffloadingConfig)):
        a = adapter(config.build(gpu_budget_gb=system_gb), MODEL, ctx(env_gb))
        gpu, source = a.gpu_side()
        assert gpu is marker
        assert source.startswith("system.gpu_budget_gb" if system_gb is not None else "environment.gpu.memory_gb")
    assert asked == [want, want]


def test_the_library_meaning_without_cuda():
    """0 is no GPU (also where the environment has a GPU), > 0 an emulated GPU of that size."""
    none, _ = FiddlerAdapter(FiddlerConfig.build(gpu_budget_gb=0.0), MODEL, ctx(24.0)).gpu_side()
    emulated, source = FiddlerAdapter(FiddlerConfig.build(), MODEL, ctx(0.5)).gpu_side()
    assert not none.has_gpu
    assert emulated.kind == GpuSide.emulated(1).kind and emulated.budget_bytes == 2**29 and "emulated" in source


def test_every_harness_path_follows_the_budget_rule(monkeypatch):
    monkeypatch.setattr(base, "gpu_budget", lambda system, env_gb: (7.5, "the rule"))
    assert simulate.gpu_budget(plain(None, 24.0)) == (Budget(7.5, int(7.5 * 2**30), "7.5 GiB as given"), "the rule")
    assert simulate.budget_info(plain(1.0, 24.0))["budget_gb"] == 7.5
    assert provenance.gpu_budget_gb(plain(1.0, 24.0)) == 7.5
    conf, _ = prepare(cfg_of("mode=simulate", "environment=rtx4090", "system=fiddler", "model=mixtral_8x7b"))
    assert schema.simulated_gpu_budget(conf)[0].bytes == int(7.5 * 2**30)
    cmd = FiddlerAdapter(FiddlerConfig.build(gpu_budget_gb=1.0), MODEL, ctx(24.0)).server_command(schema.ServeConfig())
    assert cmd[cmd.index("--gpu-budget-gb") + 1] == "7.5"
    asked = []
    monkeypatch.setattr(GpuSide, "for_budget_gb", staticmethod(lambda gb: asked.append(gb) or GpuSide.none()))
    FiddlerAdapter(FiddlerConfig.build(gpu_budget_gb=1.0), MODEL, ctx(24.0)).gpu_side()
    assert asked == [7.5]


def test_auto_is_passed_to_the_library_never_sized_by_the_harness(monkeypatch):
    """The harness hands `auto` on: to the library in execute mode and mode=simulate (whose rule,
    fiddler.gpu_budget.auto_budget_bytes, is patched here), to the server on its command line."""
    monkeypatch.setattr(gpu_budget, "auto_budget_bytes", lambda free: 12345)
    monkeypatch.setenv(gpu_budget.FAKE_FREE_ENV, str(2**30))
    gpu, _ = FiddlerAdapter(FiddlerConfig.build(gpu_budget_gb="auto"), MODEL, ctx(24.0)).gpu_side()
    assert gpu.budget_bytes == 12345
    assert simulate.gpu_budget({"system": {"gpu_budget_gb": "auto"}, "environment": {"name": "rtx4090", "gpu": {
        "memory_gb": 24.0}}})[0].bytes == 12345
    conf, _ = prepare(cfg_of("mode=simulate", "environment=rtx4090", "system=fiddler", "model=mixtral_8x7b",
                             "system.gpu_budget_gb=auto"))
    assert schema.simulated_gpu_budget(conf)[0].bytes == 12345
    cmd = FiddlerAdapter(FiddlerConfig.build(gpu_budget_gb="auto"), MODEL, ctx(24.0)).server_command(schema.ServeConfig())
    assert cmd[cmd.index("--gpu-budget-gb") + 1] == "auto"


def test_the_rule_itself():
    assert base.gpu_budget({"gpu_budget_gb": None}, 24) == (24.0, "environment.gpu.memory_gb")
    assert base.gpu_budget({"gpu_budget_gb": 0}, 24) == (0.0, "system.gpu_budget_gb")
    assert base.gpu_budget({}, None) == (0.0, "environment.gpu.memory_gb")  # a system without the option
    assert FiddlerConfig.build(gpu_budget_gb=3.0).gpu_budget(24.0) == (3.0, "system.gpu_budget_gb")
    assert FiddlerConfig.build(gpu_budget_gb="auto").gpu_budget(24.0) == ("auto", "system.gpu_budget_gb")
