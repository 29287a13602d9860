"""Planners on hand-made cases: the paper's rule, the makespan planner (exact and greedy), baselines."""

from __future__ import annotations

import itertools
import random

import pytest

from fiddler.latency import LatencyModel
from fiddler.planner import COPY, CPU, EXACT_LIMIT, GPU, get_planner, plan_makespan, plan_paper, predict

# cpu(s) = 1 ms/token + 10 ms; gpu(s) = 0.1 ms/token + 1 ms; transfer 20 ms.
# Paper rule: b iff 20 + 1 + 0.1 s < 10 + s  <=>  s > 12.2
LM = LatencyModel.manual(cpu=(1e-3, 10e-3), gpu=(1e-4, 1e-3), transfer=20e-3)


def test_paper_rule_threshold():
    counts = [1, 12, 13, 40, 0, 5, 0, 2]
    resident = [False, False, False, False, False, True, True, False]
    p = plan_paper(counts, resident, LM)
    assert p.decisions == (CPU, CPU, COPY, COPY, None, GPU, None, CPU)
    cpu = LM.cpu(1) + LM.cpu(12) + LM.cpu(2)
    gpu = LM.transfer() * 2 + LM.gpu(13) + LM.gpu(40) + LM.gpu(5)
    assert p.cpu_time == pytest.approx(cpu) and p.gpu_time == pytest.approx(gpu)
    assert p.makespan == pytest.approx(max(cpu, gpu))
    assert p.tokens(CPU) == 15 and p.tokens(COPY) == 53 and p.tokens(GPU) == 5
    assert p.experts(COPY) == [2, 3]


def test_makespan_balances_where_paper_rule_overloads_one_side():
    # Decode at batch 8: every expert gets few tokens, so the paper sends all of them to the CPU
    # (8 x 12 ms = 96 ms) while the GPU idles; copying some in overlaps the two.
    counts = [2] * 8
    resident = [False] * 8
    paper = plan_paper(counts, resident, LM)
    assert set(paper.decisions) == {CPU} and paper.makespan == pytest.approx(8 * LM.cpu(2))
    best = plan_makespan(counts, resident, LM)
    n_copy = len(best.experts(COPY))
    assert 0 < n_copy < 8
    # optimum by hand: k copies -> max((8-k) * 12 ms, k * 21.2 ms) -> k = 3: max(60, 63.6) = 63.6 ms
    assert n_copy == 3 and best.makespan == pytest.approx(3 * (LM.transfer() + LM.gpu(2)))
    assert best.makespan < paper.makespan


def test_makespan_uses_gpu_slack_from_resident_experts():
    # a heavily loaded resident expert keeps the GPU busy for 101 ms: a copy would only add to it
    counts = [1000, 30, 30]
    resident = [True, False, False]
    p = plan_makespan(counts, resident, LM)
    assert p.decisions == (GPU, CPU, CPU)
    assert p.gpu_time == pytest.approx(LM.gpu(1000)) and p.cpu_time == pytest.approx(2 * LM.cpu(30))


def test_resident_and_idle_experts():
    for planner in ("paper", "makespan", "cpu", "gpu"):
        p = get_planner(planner)([0, 3, 0, 4], [True, True, False, False], LM)
        assert p.decisions[0] is None and p.decisions[1] == GPU and p.decisions[2] is None
        assert p.decisions[3] in (COPY, CPU)
    assert get_planner("cpu")([1, 1], [False, False], LM).decisions == (CPU, CPU)
    assert get_planner("gpu")([1, 1], [False, False], LM).decisions == (COPY, COPY)
    with pytest.raises(ValueError, match="unknown planner"):
        get_planner("lru")
    with pytest.raises(ValueError, match="residency"):
        plan_paper([1, 2], [False], LM)
    with pytest.raises(ValueError, match="latency model"):
        plan_makespan([1], [False], None)


def _brute(counts, resident, lm):
    free = [e for e, (n, r) in enumerate(zip(counts, resident)) if n and not r]
    base = [GPU if (n and r) else None for n, r in zip(counts, resident)]
    best = float("inf")
    for choice in itertools.product((COPY, CPU), repeat=len(free)):
        dec = list(base)
        for e, d in zip(free, choice):
            dec[e] = d
        best = min(best, max(predict(counts, dec, lm)))
    return best


def test_makespan_is_optimal_on_random_instances():
    rng = random.Random(0)
    for _ in range(200):
        E = rng.randint(1, 10)
        counts = [rng.choice([0, 1, 2, 3, 8, 30, 100]) for _ in range(E)]
        resident = [rng.random() < 0.3 for _ in range(E)]
        lm = LatencyModel.manual(cpu=(rng.uniform(1e-5, 1e-3), rng.uniform(0, 2e-2)),
                                 gpu=(rng.uniform(1e-6, 1e-4), rng.uniform(0, 1e-3)),
                                 transfer=rng.uniform(0, 5e-2), gpu_floor=rng.uniform(0, 1e-3))
        p = plan_makespan(counts, resident, lm)
        assert p.makespan == pytest.approx(_brute(counts, resident, lm), rel=1e-9, abs=1e-15)


def test_greedy_beyond_exact_limit_beats_baselines_and_is_near_optimal():
    n = EXACT_LIMIT + 4
    counts = [(7 * i) % 23 + 1 for i in range(n)]
    resident = [False] * n
    p = plan_makespan(counts, resident, LM)
    for other in ("cpu", "gpu", "paper"):
        assert p.makespan <= get_planner(other)(counts, resident, LM).makespan
    # within one expert's cost of a lower bound on the optimum (every expert at its cheaper cost, split
    # perfectly over the two sides)
    works = [(LM.cpu(s), LM.transfer() + LM.gpu(s)) for s in counts]
    lb = sum(min(w) for w in works) / 2
    assert lb <= p.makespan <= lb + max(max(w) for w in works)
