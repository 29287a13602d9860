"""fiddler/sim: the clock, routing calibration, traces, and Fiddler's policy deciding with the engine's code."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from systems.fiddler.profiles import reference_popularity
from fiddler.config import MoEConfig
from fiddler.latency import HardwareSpec
from fiddler.placement import place
from fiddler.popularity import Popularity
from fiddler.sim import (DEFAULT_REUSE, Clock, Efficiency, FiddlerSimPolicy, ProfileRouting, RoutingRecorder,
                         RoutingTrace, SimContext, SimHardware, TraceRouting, lru_hit_rates, simulate,
                         speculative_recall)

MIXTRAL = MoEConfig.from_dict(dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                   num_local_experts=8, num_experts_per_tok=2, vocab_size=32000))
RTX4090 = HardwareSpec(1008, 165, 25, 83.2, 16, "avx512_bf16", 25)


def _ctx(budget_gb: float | None, spec=RTX4090, cpu_class="amd_zen", max_seq_len=96):
    hw = SimHardware.build(spec, Efficiency.for_classes(cpu_class), measured_limit=False)
    return SimContext(MIXTRAL, torch.bfloat16, hw, None if budget_gb is None else int(budget_gb * 2**30),
                      max_seq_len=max_seq_len, max_batch=1, popularity=reference_popularity("mixtral_8x7b"))


def _run(policy, ctx, input_len=32, output_len=16, reuse=DEFAULT_REUSE):
    policy.setup(ctx)
    return simulate(policy, ctx, ProfileRouting(reference_popularity("mixtral_8x7b"), reuse=reuse, seed=0),
                    input_len, output_len)


def test_lanes_run_in_order_and_wait_for_their_input():
    c = Clock()
    assert c.cpu.run(1.0, 2.0) == 3.0
    assert c.cpu.run(0.0, 1.0) == 4.0  # busy until 3
    assert c.gpu.run(0.5, 1.0) == 1.5  # independent lane
    assert c.busy() == {"cpu": 3.0, "gpu": 1.0, "h2d": 0.0, "d2h": 0.0}


def test_default_reuse_puts_lru_hit_rates_of_2_to_4_experts_in_the_mixtral_offloading_band():
    r = ProfileRouting(reference_popularity("mixtral_8x7b"), seed=1)
    hits = lru_hit_rates(r, (2, 3, 4), tokens=512)
    assert 0.38 <= hits[2] < hits[3] < hits[4] <= 0.62, hits  # 40-60% (second-hand summary of Fig. 2)
    assert 0.45 <= hits[3] <= 0.55
    assert 0.8 <= speculative_recall(r) <= 0.92
    no_reuse = lru_hit_rates(ProfileRouting(reference_popularity("mixtral_8x7b"), reuse=0.0, seed=1), (3,), 512)
    assert no_reuse[3] < hits[3] - 0.1  # the reuse is what makes an LRU cache work


def test_profile_routing_is_seeded_top_k_without_replacement():
    pop = reference_popularity("mixtral_8x7b")
    a = list(ProfileRouting(pop, seed=3).steps(8, 4, 2))
    b = list(ProfileRouting(pop, seed=3).steps(8, 4, 2))
    assert all((x.ids == y.ids).all() and (x.guess == y.guess).all() for x, y in zip(a, b))
    assert [s.ids.shape for s in a] == [(32, 8, 2)] + [(32, 2, 2)] * 3
    assert all((s.ids[..., 0] != s.ids[..., 1]).all() for s in a)


def test_fiddler_policy_places_with_the_engines_place():
    ctx = _ctx(24)
    policy = FiddlerSimPolicy()
    policy.setup(ctx)
    real = place(MIXTRAL, torch.bfloat16, ctx.gpu_budget_bytes, max_seq_len=96, max_batch=1,
                 popularity=reference_popularity("mixtral_8x7b"))
    assert policy.placement.resident == real.resident and real.num_resident > 0


def test_more_gpu_memory_is_faster_and_hits_more():
    results = [_run(FiddlerSimPolicy(), _ctx(gb)) for gb in (None, 12, 24, 48, 200)]
    hit = [r.stats["gpu_hit_rate"] for r in results]
    e2e = [16 / (r.ttft_s + r.decode_s) for r in results]
    assert hit[0] == 0 and hit[-1] == 1.0 and hit == sorted(hit)
    assert e2e == sorted(e2e)


def test_overlap_off_is_slower_and_planners_differ_only_in_decisions():
    on = _run(FiddlerSimPolicy(overlap=True), _ctx(24))
    off = _run(FiddlerSimPolicy(overlap=False), _ctx(24))
    assert off.decode_s > on.decode_s and off.ttft_s > on.ttft_s * 1.2
    assert on.stats["tokens"] == off.stats["tokens"]
    paper = _run(FiddlerSimPolicy(planner="paper"), _ctx(12))
    makespan = _run(FiddlerSimPolicy(planner="makespan"), _ctx(12))
    assert paper.stats["routed_tokens"] == makespan.stats["routed_tokens"]
    assert makespan.ttft_s <= paper.ttft_s * 1.001  # never worse than the paper's rule by its own prediction


def test_simulation_is_deterministic():
    a, b = (_run(FiddlerSimPolicy(), _ctx(24)) for _ in range(2))
    assert (a.ttft_s, a.decode_s, a.stats) == (b.ttft_s, b.decode_s, b.stats)


def test_routing_trace_round_trip_and_replay(tmp_path):
    rec = RoutingRecorder(2, 4, 2)
    gen = torch.Generator().manual_seed(0)
    for T in (5, 1, 1, 1):  # a prefill of 5 tokens, three decode steps
        for layer in range(2):
            rec.record(layer, torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(T)]))
    trace = rec.trace(model="test")
    assert [s.shape for s in trace.steps] == [(2, 5, 2), (2, 1, 2), (2, 1, 2), (2, 1, 2)]
    path = trace.save(tmp_path / "t.json")
    back = RoutingTrace.load(path)
    assert all((x == y).all() for x, y in zip(back.steps, trace.steps)) and back.meta["model"] == "test"
    steps = list(TraceRouting(back).steps(7, 4, 1))
    assert (steps[0].ids[:, :5] == trace.steps[0]).all() and (steps[0].ids[:, 5:] == trace.steps[0][:, :2]).all()
    assert (steps[1].ids == trace.steps[1]).all()
    assert rec.popularity().counts == back.popularity().counts
    with pytest.raises(ValueError, match="not a routing trace"):
        RoutingTrace.from_dict({"format": "x"})


def test_efficiency_overrides_are_named_and_recorded():
    eff = Efficiency.for_classes("intel_sapphire_rapids").with_overrides({"cpu.kernel_bw_fraction": 0.5})
    assert eff.cpu.kernel_bw_fraction == 0.5 and "override" in eff.cpu.sources["kernel_bw_fraction"]
    with pytest.raises(ValueError, match="unknown efficiency factor"):
        eff.with_overrides({"cpu.nonsense": 1})
    slow = _run(FiddlerSimPolicy(), _ctx(None, cpu_class="amd_zen"))
    hw = SimHardware.build(RTX4090, Efficiency.for_classes("amd_zen").with_overrides({"cpu.kernel_bw_fraction": 0.4}),
                           measured_limit=False)
    ctx = SimContext(MIXTRAL, torch.bfloat16, hw, None, max_seq_len=96, max_batch=1)
    slower = _run(FiddlerSimPolicy(), ctx)
    assert slower.decode_s > slow.decode_s * 2


def test_the_simulator_package_imports_no_harness_code():
    import pathlib

    import fiddler.sim

    src = "\n".join(p.read_text() for p in pathlib.Path(fiddler.sim.__file__).parent.glob("*.py"))
    assert not any(f"{kw} {pkg}" in src for kw in ("import", "from") for pkg in ("runners", "systems", "hydra"))


def test_a_beam_trace_replays_its_decode_rows():
    steps = [np.zeros((2, 6, 2), dtype=np.int64)] + [np.full((2, 4, 2), i, dtype=np.int64) for i in (1, 2)]
    steps = [np.stack([s[..., 0], (s[..., 0] + 1) % 4], axis=-1) for s in steps]
    trace = RoutingTrace(2, 4, 2, steps)
    got = list(TraceRouting(trace).steps(6, 3, 4))
    assert got[0].ids.shape == (2, 6, 2) and (got[1].ids[..., 0] == 1).all() and (got[2].ids[..., 0] == 2).all()
