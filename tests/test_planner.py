"""Planners on hand-made cases: the paper's rule, the makespan planner (exact and greedy), baselines."""

from __future__ import annotations

import itertools
import random

import pytest

from fiddler.latency import LatencyModel
from fiddler.planner import (COPY, CPU, EXACT_LIMIT, GPU, get_planner, gpu_queue, plan_makespan, plan_paper,
                             predict)

# cpu(s) = 1 ms/token + 10 ms; gpu(s) = 0.1 ms/token + 1 ms; transfer 20 ms.
# Paper rule: b iff 20 + 1 + 0.1 s < 10 + s  <=>  s > 12.2
LM = LatencyModel.manual(cpu=(1e-3, 10e-3), gpu=(1e-4, 1e-3), transfer=20e-3)


def test_paper_rule_threshold():
    counts = [1, 12, 13, 40, 0, 5, 0, 2]
    resident = [False, False, False, False, False, True, True, False]
    p = plan_paper(counts, resident, LM)
    assert p.decisions == (CPU, CPU, COPY, COPY, None, GPU, None, CPU)
    cpu = LM.cpu(1) + LM.cpu(12) + LM.cpu(2)
    # resident expert 5 (1.5 ms) runs while expert 2 is copied (0-20 ms); expert 2 runs 20-22.3 ms while
    # expert 3 is copied into the second buffer (20-40 ms); expert 3 runs 40-45 ms
    gpu = 2 * LM.transfer() + LM.gpu(40)
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
    # optimum by hand: k copies -> max((8-k) * 12 ms, k * 20 ms + 1.2 ms) (each copy overlaps the compute
    # of the expert before it) -> k = 3: max(60, 61.2) = 61.2 ms
    assert n_copy == 3 and best.makespan == pytest.approx(3 * LM.transfer() + LM.gpu(2))
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


def test_gpu_queue_is_the_two_buffer_pipeline():
    # copies of 10 s; computes 4, 30, 2, 1 s after 5 s of resident experts. By hand, with two buffers:
    #   copy 0: 0-10            compute 0: max(5, 10) = 10 -> 14
    #   copy 1: 10-20 (buf 1)   compute 1: max(14, 20) = 20 -> 50
    #   copy 2: waits for buffer 0 (free at 14) and the engine (20): 20-30; compute 2: max(50, 30) -> 52
    #   copy 3: waits for buffer 1 (free at 50): 50-60;             compute 3: max(52, 60) -> 61
    assert gpu_queue(5.0, 10.0, [4.0, 30.0, 2.0, 1.0]) == pytest.approx(61.0)
    # copies serial with compute would have been 5 + 4 * 10 + 37 = 82 s; compute-bound: residents + all
    assert gpu_queue(100.0, 1.0, [2.0, 2.0]) == pytest.approx(104.0)
    assert gpu_queue(0.0, 3.0, []) == 0.0 and gpu_queue(7.0, 3.0, []) == 7.0
    # predict() times copied-in experts in expert order after the residents, as the executor runs them
    counts = [4, 30, 0, 2, 1]
    lm = LatencyModel.manual(cpu=(1.0, 0.0), gpu=(1.0, 0.0), transfer=10.0)
    cpu, gpu = predict(counts, (COPY, COPY, None, COPY, COPY), lm)
    assert cpu == 0.0 and gpu == pytest.approx(gpu_queue(0.0, 10.0, [4.0, 30.0, 2.0, 1.0]))
    cpu, gpu = predict(counts, (CPU, COPY, None, GPU, COPY), lm)
    assert cpu == 4.0 and gpu == pytest.approx(max(max(2.0, 10.0) + 30.0, 20.0) + 1.0)


def test_makespan_counts_copies_overlapped_with_compute():
    # three experts of 20 tokens: CPU 30 ms each, copy 20 ms + 3 ms compute. Two copied + one on the CPU:
    # the second copy overlaps the first expert's compute -> max(30, 20 + 20 + 3) = 43 ms (counted
    # serially it was 46 ms); all copied 63 ms, one copied 60 ms, all on the CPU 90 ms.
    counts = [20, 20, 20]
    p = plan_makespan(counts, [False] * 3, LM)
    assert p.makespan == pytest.approx(2 * LM.transfer() + LM.gpu(20))
    assert len(p.experts(COPY)) == 2 and len(p.experts(CPU)) == 1


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
    # perfectly over the two sides; a copied expert costs the GPU queue at least its copy)
    works = [(LM.cpu(s), LM.transfer()) for s in counts]
    lb = sum(min(w) for w in works) / 2
    assert lb <= p.makespan <= lb + max(max(w) for w in works) + LM.gpu(max(counts))
