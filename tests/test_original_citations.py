"""Every parameter of a system as the paper ran it (`*_original`) carries a citation in the fixed format
(systems/citations.py), and the systems are wired: their yaml selects the cited policy."""
from __future__ import annotations

import pytest

from systems.citations import Cited, citation_problem


def _params():
    from systems.fiddler.original_sim import PARAMS as F
    from systems.llama_cpp.original_sim import PARAMS as L

    return [("fiddler_original", k, v) for k, v in F.items()] + [("llama_cpp_original", k, v) for k, v in L.items()]


@pytest.mark.parametrize("system,name,param", _params(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_original_parameter_is_cited(system, name, param):
    assert isinstance(param, Cited), f"{system}.{name} is not a Cited parameter"
    problem = citation_problem(param.source)
    assert problem is None, f"{system}.{name}: {problem}"


@pytest.mark.parametrize("source", ["efeslab/fiddler@227715b:src/fiddler/mixtral.py#L38-39",
                                    "ggml-org/llama.cpp@5ca0944:llama.cpp#L14836", "arXiv:2402.07033 §4.1",
                                    "results/measured/x-y/z.json", "assumption: no source states it, so this"])
def test_citation_formats_accepted(source):
    assert citation_problem(source) is None


@pytest.mark.parametrize("source", ["", "mixtral.py line 38", "efeslab/fiddler:src/fiddler/mixtral.py#L38",
                                    "efeslab/fiddler@227715b:src/fiddler/mixtral.py", "assumption:", "see the paper"])
def test_citation_formats_refused(source):
    assert citation_problem(source) is not None


def test_original_torch_factors_come_from_the_cited_measurement():
    import json
    from pathlib import Path

    from systems.fiddler import original_sim

    root = Path(__file__).resolve().parents[1]
    m = json.loads((root / original_sim.PARAMS["torch_factors"].source).read_text())
    assert original_sim.TORCH_FACTORS["intel_sapphire_rapids"]["gbps_per_core"] == pytest.approx(
        m["native_gbps_1tok"] / m["threads"], rel=0.01)
    assert original_sim.TORCH_FACTORS["intel_skylake_avx512"]["gflops_per_core"] == pytest.approx(
        m["avx512_core_gflops_per_core_128tok"], rel=0.01)


def test_prefix_schedules_bound_the_measured_one():
    from systems.llama_cpp.original_sim import prefix_schedule

    for b in (4, 8, 12, 16):
        lo, hi, mid = (prefix_schedule(m, b, 63) for m in ("prompt", "all_but_last", "measured"))
        assert all(l <= x <= h for l, x, h in zip(lo, mid, hi))


def test_llama_cpp_2024_f16_ratios_come_from_the_cited_measurement():
    """cpu_decode_vs_today / cpu_prompt_vs_today: the medians over rounds of the 2024 build's F16 run over
    today's bf16 run in the same round (the committed readings)."""
    import json
    import statistics
    from pathlib import Path

    from systems.llama_cpp import original_sim

    root = Path(__file__).resolve().parents[1]
    src = Path(original_sim.PARAMS["cpu_decode_vs_today"].source)
    rows = [json.loads(line) for line in (root / src.parent / "bench_llama_build.jsonl").read_text().splitlines()
            if line.startswith("{")]
    old = {r["round"]: r for r in rows if r["side"] == "old" and r["gguf"].endswith("-f16.gguf")}
    new = {r["round"]: r for r in rows if r["side"] == "new" and r["gguf"].endswith("-bf16.gguf")}
    assert len(old) == len(new) == 5
    for key, param in (("best_decode_tok_s", "cpu_decode_vs_today"), ("best_prompt_tok_s", "cpu_prompt_vs_today")):
        med = statistics.median(old[r][key] / new[r][key] for r in old)
        assert original_sim.PARAMS[param].value == pytest.approx(med, abs=0.005), param


def test_llama_cpp_original_runs_f16_with_the_2024_factors(tmp_path):
    from systems.llama_cpp import original_sim
    from systems.llama_cpp.sim import CPU_FACTORS
    from runners.main import run_job
    from tests.test_harness import cfg_of

    def run(*extra, name):
        return run_job(cfg_of("mode=simulate", "model=mixtral_8x7b", "run.progress=false", "environment=paper_env2",
                              "system=llama_cpp_original", f"run.index_path={tmp_path / 'index.jsonl'}",
                              "run.force=true", "workload.input_lens=[32]", "workload.output_lens=[4]", *extra),
                       tmp_path / name)

    (rec,) = run(name="f16")
    assert rec["status"] == "ok", rec.get("reason")
    got = rec["system_info"]["cpu_factors"]
    today = CPU_FACTORS["intel_sapphire_rapids"]
    assert got["bw_fraction"] == pytest.approx(today["bw_fraction"] * original_sim.PARAMS["cpu_decode_vs_today"].value)
    assert got["gflops_per_core"] == pytest.approx(
        today["gflops_per_core"] * original_sim.PARAMS["cpu_prompt_vs_today"].value)
    (bad,) = run("system.quant=bf16", name="bf16")
    assert bad["status"] != "ok" and "F16" in bad.get("reason", "").upper()
