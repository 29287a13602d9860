"""Latency model: fits, hardware-spec derivation, calibration by timing real paths, caching."""

from __future__ import annotations


import pytest
import torch

from fiddler import latency
from fiddler.config import MoEConfig
from fiddler.latency import HardwareSpec, LatencyModel, calibrate, fit_linear, fit_roofline
from runners.hardware import hardware_spec

MIXTRAL = MoEConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, num_experts=8, top_k=2, num_heads=32,
                    num_kv_heads=8, head_dim=128, vocab_size=32000)


def test_fit_linear_exact_and_robust():
    pts = [(s, 3e-4 * s + 2e-3) for s in (1, 2, 4, 8, 16, 32)]
    a, b = fit_linear(pts)
    assert a == pytest.approx(3e-4) and b == pytest.approx(2e-3)
    # one preempted sample (10x slower) barely moves the fit
    noisy = pts[:3] + [(8, 10 * pts[3][1])] + pts[4:]
    a2, b2 = fit_linear(noisy)
    assert a2 == pytest.approx(3e-4, rel=0.05) and b2 == pytest.approx(2e-3, rel=0.05)
    # constant timings: slope 0; decreasing noise never yields a negative slope or intercept
    assert fit_linear([(1, 5.0), (2, 5.0), (4, 5.0)]) == (0.0, 5.0)
    a3, b3 = fit_linear([(1, 3.0), (2, 2.0), (4, 1.0)])
    assert a3 >= 0 and b3 >= 0
    with pytest.raises(ValueError):
        fit_linear([])


def test_fit_roofline_recovers_flat_then_linear():
    true = LatencyModel.manual(cpu=(0, 0), gpu=(1e-5, 1e-4), transfer=0, gpu_floor=1e-3)
    pts = [(s, true.gpu(s)) for s in (1, 2, 4, 8, 16, 64, 128, 256, 512)]
    a, b, floor = fit_roofline(pts)
    fitted = LatencyModel.manual(cpu=(0, 0), gpu=(a, b), transfer=0, gpu_floor=floor)
    for s, t in pts:
        assert fitted.gpu(s) == pytest.approx(t, rel=1e-6)
    # a straight line is the special case without a floor: predictions match between the samples too
    a, b, floor = fit_roofline([(s, 2e-6 * s + 1e-5) for s in (1, 4, 16, 64)])
    line = LatencyModel.manual(cpu=(0, 0), gpu=(a, b), transfer=0, gpu_floor=floor)
    for s in (1, 2, 3, 10, 40, 100):
        assert line.gpu(s) == pytest.approx(2e-6 * s + 1e-5, rel=1e-6)
    assert floor == 0  # equally good fits: the simpler one wins


def test_model_functions_and_roundtrip():
    lm = LatencyModel.manual(cpu=(1e-3, 2e-2), gpu=(1e-5, 1e-4), transfer=5e-2, gpu_floor=3e-4)
    assert lm.cpu(0) == 0 and lm.gpu(0) == 0
    assert lm.cpu(10) == pytest.approx(3e-2)
    assert lm.gpu(1) == pytest.approx(3e-4) and lm.gpu(100) == pytest.approx(1.1e-3)
    assert lm.transfer() == 5e-2
    assert LatencyModel.from_dict(lm.to_dict()) == lm


def test_from_hardware_spec_mixtral_on_paper_env1():
    # conf/environment/paper_env1.yaml's numbers (Quadro RTX 6000 + Xeon Gold 6126), as nested dicts
    env = {"gpu": {"mem_bandwidth_gbps": 672, "bf16_tflops": 16.3}, "pcie": {"h2d_gbps": 12, "d2h_gbps": 12},
           "cpu": {"cores": 12, "mem_bandwidth_gbps": 128, "isa": "avx512", "threads": 12}}
    spec = hardware_spec(env)
    lm = LatencyModel.from_hardware_spec(spec, MIXTRAL, torch.bfloat16)
    eb = 3 * 4096 * 14336 * 2
    assert lm.source == "hardware_spec" and lm.meta["expert_bytes"] == eb
    assert lm.transfer() == pytest.approx(eb / 12e9 + spec.pcie_latency_s)  # ~29 ms per expert
    assert lm.cpu_b == pytest.approx(eb / (128e9 * 0.8) + spec.cpu_call_overhead_s)
    assert lm.gpu_floor == pytest.approx(eb / (672e9 * 0.8) + spec.gpu_launch_overhead_s)
    flops = 6 * 4096 * 14336
    assert lm.gpu_a == pytest.approx(flops / (16.3e12 * 0.5))
    cpu_flops = 12 * 2.5e9 * 32 * 0.5
    assert lm.cpu_a == pytest.approx(flops / cpu_flops + 2 * 4096 * 2 / 12e9)
    # the paper's observation: for one token the CPU beats copying the expert in
    assert lm.cpu(1) < lm.transfer() + lm.gpu(1)
    # and for a long prefill the copy wins
    assert lm.cpu(512) > lm.transfer() + lm.gpu(512)


def test_from_hardware_spec_without_gpu_never_prefers_gpu():
    spec = HardwareSpec(gpu_mem_bandwidth_gbps=0, gpu_bf16_tflops=0, pcie_h2d_gbps=0, cpu_mem_bandwidth_gbps=50,
                        cpu_cores=2)
    lm = LatencyModel.from_hardware_spec(spec, MIXTRAL)
    assert lm.gpu(1) == float("inf") and lm.transfer() == float("inf") and lm.cpu(1) < 1
    with pytest.raises(ValueError, match="unknown cpu_isa"):
        HardwareSpec(1, 1, 1, 1, 1, cpu_isa="sse2").cpu_flops_per_cycle()


class FakeClock:
    """Deterministic stand-in for time.perf_counter: the timed functions advance it by their cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_calibrate_fits_timed_paths_and_caches(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(latency.time, "perf_counter", clock)
    latency.clear_cache()
    calls = {"cpu": 0}

    def cpu_fn(s):
        calls["cpu"] += 1
        clock.now += 2e-3 + 2e-4 * s + (0.05 if calls["cpu"] == 9 else 0.0)  # one preempted run

    def gpu_fn(s):
        clock.now += max(1e-3, 1e-5 * s + 2e-4)

    def copy_fn():
        clock.now += 5e-3

    lm = calibrate(cpu_fn, gpu_fn, copy_fn, token_counts=(1, 2, 4, 8, 16, 256), repeats=2, cache_key=("unit", 1))
    assert lm.source == "calibrated"
    assert [s for s, _ in lm.samples["cpu"]] == [1, 2, 4, 8, 16, 256] and len(lm.samples["transfer"]) == 2
    assert lm.cpu_a == pytest.approx(2e-4) and lm.cpu_b == pytest.approx(2e-3)  # best-of-2 drops the outlier
    assert lm.gpu(1) == pytest.approx(1e-3) and lm.gpu(256) == pytest.approx(1e-5 * 256 + 2e-4)
    assert lm.transfer() == pytest.approx(5e-3)
    n = calls["cpu"]
    assert calibrate(cpu_fn, None, None, cache_key=("unit", 1)) is lm and calls["cpu"] == n
    latency.clear_cache()


@pytest.mark.parametrize("env", ["paper_env1", "paper_env2", "rtx3060", "rtx4090"])
def test_every_described_environment_gives_a_hardware_spec(env):
    """The harness's environment configs, composed and resolved as the runner does, build a HardwareSpec."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tests.test_harness import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"environment={env}"])
    resolved = OmegaConf.to_container(cfg.environment, resolve=True, enum_to_str=True)
    spec = hardware_spec(resolved)
    assert spec.cpu_cores >= 1 and spec.cpu_mem_bandwidth_gbps > 0 and spec.gpu_mem_bandwidth_gbps > 0
    assert LatencyModel.from_hardware_spec(spec, MIXTRAL).cpu(1) > 0
