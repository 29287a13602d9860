"""The simulator's validation (runners/validate_sim.py): (2) the RTX 6000 Ada baseline runs, (3) the
paper's Fig. 4 orderings, (1) this host's execute vs simulate on small_mixtral (slow)."""
from __future__ import annotations

import pytest

from runners import validate_sim


@pytest.fixture(scope="module")
def ada():
    return validate_sim.check_ada6000()


def test_deepspeed_zero_inference_matches_the_ada6000_runs_within_30_percent(ada):
    rows, passed = ada
    ds = [r for r in rows if r["system"] == "deepspeed_mii"]
    assert len(ds) == 20 * 2 + 6  # every single-batch point (TTFT and decode) and every long prefill
    assert passed["deepspeed_mii ttft_s"] and passed["deepspeed_mii decode_tok_s"], [r for r in ds if not r["pass"]]


def test_mixtral_offloadings_released_code_matches_the_ada6000_ttft_within_30_percent(ada):
    _, passed = ada
    assert passed["mixtral_offloading_original ttft_s"]


def test_mixtral_offloadings_released_code_matches_the_ada6000_decode_within_30_percent(ada):
    rows, passed = ada
    mo = [r for r in rows if r["config"].startswith("system=mixtral_offloading_original")]
    # simulated with the cache the measured runs had (the authors' offload_per_layer = 5), not the derived 4
    assert mo and all("system.cache_size=3" in r["config"] for r in mo)
    assert passed["mixtral_offloading_original decode_tok_s"], [r for r in mo if not r["pass"]]


def test_every_pairwise_ordering_of_the_papers_fig4_holds():
    values, orders, ok = validate_sim.check_fig4()
    assert len(orders) == 12 and len([v for v in values if v["in_orderings"]]) == 8
    assert ok, [o for o in orders if not o["match"]]
    assert all(v["ratio"] is not None for v in values)


def test_fig4_with_the_systems_as_the_paper_ran_them_is_reported_pair_by_pair():
    values, orders, _ = validate_sim.check_fig4(validate_sim.FIG4_ORIGINAL, {})
    assert len(orders) == 12 and {v["config"] for v in values if v["system"] == "fiddler"} == {"system=fiddler_original"}
    assert all(v["simulated_e2e_tok_s"] is not None for v in values)


def test_this_hosts_committed_execute_records_are_simulated_within_bounds():
    rows, ok = validate_sim.check_host_records()
    assert len(rows) == 3 * 2 * 2  # three sweeps x fiddler, llama_cpp x decode, TTFT
    assert ok, [r for r in rows if not r["pass"]]
