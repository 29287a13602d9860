"""The simulator's cache is the engine's cache: hit rates in execute mode on the emulated GPU against the same
routing replayed in mode=simulate (issue 52).

1. Execute small_mixtral once with system.record_routing=true and static placement from its default profile
   (uniform): the model's own routing, whose popularity this script measures.
2. Build a shifted profile: the same counts given to the experts in reverse order of popularity per layer (the
   most routed expert gets the least routed one's count), so placement starts from the experts the model uses
   least. Written next to the results.
3. For each policy: execute with that profile, a budget that holds --fraction of the experts, one generate
   (no warm-up: the cache starts from the placement) with the routing recorded; then replay that routing in
   mode=simulate on --sim-env with the same budget, model and points (sim.trace=...), deciding with the latency
   model the engine calibrated (sim.latency_model=trace: the same inputs to the same decisions); the two hit
   rates. (With the spec's latency model instead, the plans differ, and with them which copies may be kept.)

    python scripts/residency_trace_check.py --out results/measured/<dir>
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(overrides: list[str], run_dir: Path, index: Path) -> dict:
    from hydra import compose, initialize_config_dir

    from runners.main import run_job

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "run.resume=false", f"run.index_path={index}",
                                           "run.progress=false", "run.isolation=inline"])
    with contextlib.redirect_stdout(io.StringIO()):
        (rec,) = run_job(cfg, run_dir)
    if rec["status"] != "ok":
        raise RuntimeError(f"{overrides}: {rec['status']}: {rec.get('reason')}")
    return rec


def find(d, key):
    """The first value of `key` in nested dicts (an engine's info holds its executor's placement deeper)."""
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            found = find(v, key)
            if found is not None:
                return found
    return None


def budget_gb(model: str, fraction: float, max_seq_len: int) -> float:
    """GPU budget (GiB) that holds the reservation and `fraction` of the experts."""
    import torch

    from fiddler.config import MoEConfig
    from fiddler.placement import reservation
    from runners.main import prepare, resolve_model_path
    from tests.test_harness import cfg_of

    cfg = MoEConfig.from_pretrained(resolve_model_path(prepare(cfg_of(f"model={model}"))[0]))
    need = sum(reservation(cfg, torch.bfloat16, max_seq_len, 1).values())
    experts = int(fraction * cfg.num_moe_layers * cfg.expert_slots)
    return (need + experts * cfg.expert_bytes(torch.bfloat16) + (1 << 20)) / 2**30


def reversed_profile(trace_path: str, out: Path) -> Path:
    from fiddler.sim import RoutingTrace

    pop = RoutingTrace.load(trace_path).popularity()
    rows = []
    for row in pop.counts:
        order = sorted(range(len(row)), key=lambda e: -row[e])
        rev = [0.0] * len(row)
        for hi, lo in zip(order, reversed(order)):
            rev[hi] = row[lo]
        rows.append(rev)
    out.write_text(json.dumps({"expert_popularity": rows, "total_input_tokens": int(sum(map(sum, rows)) / pop.top_k),
                               "top_k": pop.top_k,
                               "source": f"reversed per layer from the routing of {Path(trace_path).name}"}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small_mixtral")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--sim-env", default="rtx4090")
    ap.add_argument("--policies", nargs="+", default=["static", "lru", "lfu"])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="residency-trace-"))
    index = work / "index.jsonl"
    gb = budget_gb(a.model, a.fraction, a.input_len + a.output_len)
    points = [f"workload.input_lens=[{a.input_len}]", f"workload.output_lens=[{a.output_len}]",
              "workload.repetitions=1", "workload.warmup=0"]
    common = [f"model={a.model}", "system=fiddler", f"system.gpu_budget_gb={gb}", *points]
    t0 = time.time()
    first = run([*common, "environment=local", "system.record_routing=true"], work / "first", index)
    profile = reversed_profile(first["routing_trace"], a.out / "shifted_profile.json")
    rows = []
    for pol in a.policies:
        ex = run([*common, "environment=local", "system.record_routing=true", f"system.residency={pol}",
                  f"system.popularity_profile={profile}"], work / f"ex-{pol}", index)
        trace = a.out / f"trace-{pol}.json"
        Path(ex["routing_trace"]).replace(trace)
        sim = run([*common, "mode=simulate", f"environment={a.sim_env}", f"system.residency={pol}",
                   f"system.popularity_profile={profile}", f"sim.trace={trace}", "sim.latency_model=trace"],
                  work / f"sim-{pol}", index)
        e, s = ex["stats"]["executor"], sim["stats"]["executor"]
        row = {"policy": pol, "execute_hit_rate": e["gpu_hit_rate"], "simulate_hit_rate": s["gpu_hit_rate"],
               "difference_points": 100 * (s["gpu_hit_rate"] - e["gpu_hit_rate"]),
               "execute_residency": e.get("residency"), "simulate_residency": s.get("residency"),
               "execute_resident": find(ex["system_info"], "num_resident"),
               "simulate_resident": find(sim["system_info"], "num_resident"),
               "execute_cpu": ex.get("environment_info", {}).get("cpu", {}).get("name"),
               "execute_decode_tok_s": ex["metrics"]["decode_tok_s"]}
        rows.append(row)
        print(f"[{time.time() - t0:5.0f}s] {pol}: execute {row['execute_hit_rate']:.4f}  simulate "
              f"{row['simulate_hit_rate']:.4f}  ({row['difference_points']:+.2f} points)", flush=True)
    summary = {"model": a.model, "budget_gb": gb, "fraction": a.fraction, "input_len": a.input_len,
               "output_len": a.output_len, "sim_env": a.sim_env, "profile": str(profile.name), "rows": rows,
               "max_abs_difference_points": max(abs(r["difference_points"]) for r in rows)}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
