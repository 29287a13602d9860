"""The planner's time per layer, in units of a fixed pure-Python workload timed in the same rounds
(lower is better).

The plan is made on the critical path of every layer, so its cost must stay a small fraction of the
layer's predicted expert time (the plan's makespan under the latency model); each record keeps that
fraction (`fraction_of_expert_time`). The regression ratio is not that fraction: an absolute Python time
over a constant moved 1.7x between processes of the same build on one VM (a whole process ran slow, on
both builds alike, AMD EPYC Zen 3 and Zen 5 and Intel Xeon), and 3x between days, so its floor failed CI
on noise. The yardstick (benchmarks/conftest.py's python_yardstick), interleaved round by round, slows
with the process and cancels that: the ratio moves only when the planner's own work grows. Two shapes: Mixtral-8x7B
(8 experts, top-2) and a Qwen3-30B-A3B-like layer (128 experts of 768, top-8), on the RTX 4090
environment's spec (conf/environment/rtx4090.yaml), with a quarter of the experts resident on the
GPU; a decode step (1 token) and a 16-token step (beams or a short prefill chunk).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fiddler.config import MoEConfig
from fiddler.latency import LatencyModel
from fiddler.planner import get_planner
from runners.hardware import hardware_spec

from .conftest import interleaved, python_yardstick, record_ratio

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "mixtral_8x7b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_experts=8, top_k=2,
                         num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=32000),
    "e128k8": dict(hidden_size=2048, intermediate_size=768, num_layers=48, num_experts=128, top_k=8,
                   num_heads=32, num_kv_heads=4, head_dim=128, vocab_size=151936),
}
LAYERS = 64  # routings planned per round (a layer each)


def latency_model(cfg: MoEConfig) -> LatencyModel:
    env = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "environment" / "rtx4090.yaml"), resolve=False)
    env["cpu"]["threads"] = env["cpu"]["cores"]
    return LatencyModel.from_hardware_spec(hardware_spec(env), cfg)


def routings(cfg: MoEConfig, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(LAYERS):
        counts = [0] * cfg.num_experts
        for _ in range(tokens):
            for e in rng.sample(range(cfg.num_experts), cfg.top_k):
                counts[e] += 1
        out.append(counts)
    return out


@pytest.mark.parametrize("planner", ["makespan", "paper"])
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_planner_fraction(benchmark, rounds, shape, tokens, planner):
    cfg = MoEConfig(**SHAPES[shape])
    lm = latency_model(cfg)
    plan = get_planner(planner)
    rng = random.Random(1)
    resident = [rng.random() < 0.25 for _ in range(cfg.num_experts)]
    layers = routings(cfg, tokens, seed=tokens)
    predicted = sum(plan(c, resident, lm).makespan for c in layers) / LAYERS

    def side(i):
        t = time.perf_counter()
        for c in layers:
            plan(c, resident, lm)
        return (time.perf_counter() - t) / LAYERS

    def yardstick(i):
        python_yardstick()  # its checksum is a float, which interleaved() would take for a time: timed here

    best = interleaved(benchmark, {"planner_s": side, "yardstick_s": yardstick}, rounds)
    record_ratio(benchmark, f"planner_vs_python_{planner}_{shape}_t{tokens}", best["planner_s"] / best["yardstick_s"],
                 "lower", {**best, "predicted_expert_s": predicted,
                           "fraction_of_expert_time": best["planner_s"] / predicted},
                 f"{planner} planner time per layer / a fixed pure-Python workload's time, {shape}, {tokens} token(s)",
                 margin=0.5)  # pure Python: its speed relative to the yardstick still differs between CPUs
