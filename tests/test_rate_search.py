"""The rate search (runners/serving/rate_search.py) and its limits (runners/serving/workload.py), on injected measurements: a
fake server whose p99s grow with the rate as a queue's do, so the answers are known exactly. No timing is
measured here."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from runners.serving import rate_search
from runners.serving.rate_search import Bracket, Slo, Trial, search
from runners.serving.workload import slos


def fake_server(knee: float, base_ttft: float = 0.1, base_tpot: float = 0.02):
    """p99s that stay at base up to `knee` requests/s and explode past it; records the rates asked."""
    asked: list[float] = []

    def measure(rate: float) -> Trial:
        asked.append(rate)
        load = 1.0 if rate <= knee else 1 + 50 * (rate - knee)
        return Trial(rate, base_ttft * load, base_tpot * load, requests=64)

    return measure, asked


def test_the_search_starts_at_capacity_and_brackets_each_slo():
    measure, asked = fake_server(knee=0.6)
    limits = [Slo("mlperf", 2.0, 0.2), Slo("scaled", 0.3, 0.06)]
    trials, brackets = search(measure, capacity=1.0, slos=limits, max_trials=5)
    assert asked[0] == 1.0 and len(trials) <= 5  # at most 5 rates, the first at capacity
    assert all(t.requests == 64 for t in trials)
    for name in ("mlperf", "scaled"):
        b = brackets[name]
        # every rate within was within, every rate beyond was beyond: the answer is a measured rate
        assert b.within is not None and b.within in asked
        assert b.beyond is None or b.within < b.beyond
        for t in trials:
            met = next(s for s in limits if s.name == name).met(t)
            assert met == (t.rate <= b.within)


def test_the_answer_converges_on_the_knee():
    measure, _ = fake_server(knee=0.37)
    trials, brackets = search(measure, capacity=1.0, slos=[Slo("scaled", 0.3, 0.06)], max_trials=5)
    b = brackets["scaled"]
    assert b.within <= 0.37 < b.beyond  # the knee lies in the bracket
    assert b.beyond / b.within < 1.5  # five rates narrow it from 2x


def test_a_server_within_the_limits_at_capacity_is_tried_above_it():
    measure, asked = fake_server(knee=100.0)
    trials, brackets = search(measure, capacity=1.0, slos=[Slo("mlperf", 2.0, 0.2)], max_trials=3)
    assert asked == [1.0, 1.5, 2.25] and brackets["mlperf"].within == 2.25 and brackets["mlperf"].beyond is None


def test_no_rate_within_the_limits_says_so():
    measure, asked = fake_server(knee=0.0, base_ttft=5.0)  # TTFT 5 s even unloaded
    trials, brackets = search(measure, capacity=1.0, slos=[Slo("mlperf", 2.0, 0.2)], max_trials=4)
    assert asked == [1.0, 0.5, 0.25, 0.125] and brackets["mlperf"].within is None


def test_the_search_stops_once_the_bracket_is_narrow():
    b = Bracket(within=1.0, beyond=1.05)
    assert b.width() == pytest.approx(1.05)
    calls = []

    def measure(rate):
        calls.append(rate)
        return Trial(rate, 0.1 if rate <= 1.0 else 9.0, 0.01, 64)

    search(measure, capacity=1.0, slos=[Slo("s", 1.0, 1.0)], max_trials=5, resolution=1.6)
    assert calls == [1.0, 1.5]  # 1.5x up, beyond: bracket 1.5 <= resolution


def test_a_capacity_of_zero_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        search(lambda r: Trial(r, 0, 0, 64), capacity=0.0, slos=[Slo("s", 1, 1)])


def test_the_limits_are_mlperfs_as_p99_and_scaled_to_the_unloaded_latency():
    w = SimpleNamespace(slo_ttft_s=2.0, slo_tpot_s=0.2, slo_scale=3.0)
    assert slos(w, None) == [Slo("mlperf", 2.0, 0.2)]  # no unloaded level: no scaled limits
    limits = slos(w, {"ttft_p50_s": 0.25, "tpot_p50_s": 0.05})
    assert limits[1].name == "scaled"
    assert math.isclose(limits[1].ttft_s, 0.75) and math.isclose(limits[1].tpot_s, 0.15)
    # a p99 exactly at the limit is within it; just above is not
    assert limits[0].met(Trial(1.0, 2.0, 0.2, 64)) and not limits[0].met(Trial(1.0, 2.0001, 0.2, 64))
    assert rate_search.Slo("x", 1, 1).met(Trial(1.0, 0.5, 0.5, 64))
