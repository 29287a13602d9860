"""Adaptive residency under distribution shift, in mode=simulate (issue 52's evaluation).

Place the GPU's experts from one subject's popularity profile and route from another's, for every ordered pair
of the profiles in --profiles (42 pairs for the seven MMLU subjects), on each --env. Per pair: static placement
from the placement subject (mismatched static), each adaptive policy from the same start, and static placement
from the routing subject's own profile (the oracle static); decode tok/s and GPU hit rate of each, and the share
of the gap between mismatched static and the oracle that each adaptive policy closes. Pairs of a subject with
itself are the no-shift rows. Every run goes through the harness (Hydra compose + runners.main.run_job), so the
records are the same as `python run.py mode=simulate ...` writes.

    python scripts/eval_residency.py --out results/measured/<dir> [--envs rtx4090 rtx3060] [--reuse 0]
    python scripts/eval_residency.py --profiles results/reference/mixtral-8x7b/expert-popularity/original ...

Writes <out>/pairs.jsonl (one row per env, pair and policy), <out>/summary.json and prints the table.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

INSTRUCT = ROOT / "results" / "reference" / "mixtral-8x7b" / "expert-popularity" / "instruct"


class PlannerClock:
    """Times, per layer call of the simulated runs, the planner (unmemoised: the simulator reuses a plan for the
    same counts and resident set, the engine plans every call) and the residency step (ExpertCache.step), on
    this host's CPU."""

    def __init__(self):
        from fiddler.residency import ExpertCache
        from fiddler.sim.fiddler_policy import FiddlerSimPolicy

        self.calls = self.plan_s = self.step_s = 0.0
        clock, plan, step = self, FiddlerSimPolicy._plan, ExpertCache.step

        def timed_plan(policy, layer, counts):
            t = time.perf_counter()
            policy.planner(list(counts), policy.cache.resident[layer], policy.lm)
            clock.plan_s += time.perf_counter() - t
            clock.calls += 1
            return plan(policy, layer, counts)

        def timed_step(cache, *a, **kw):
            t = time.perf_counter()
            out = step(cache, *a, **kw)
            clock.step_s += time.perf_counter() - t
            return out

        FiddlerSimPolicy._plan, ExpertCache.step = timed_plan, timed_step
        self._undo = lambda: (setattr(FiddlerSimPolicy, "_plan", plan), setattr(ExpertCache, "step", step))

    def take(self) -> dict:
        out = {"layer_calls": int(self.calls), "planner_us": 1e6 * self.plan_s / max(self.calls, 1),
               "residency_step_us": 1e6 * self.step_s / max(self.calls, 1)}
        self.calls = self.plan_s = self.step_s = 0.0
        return out


def run_point(overrides: list[str], clock: PlannerClock | None = None) -> dict:
    """One simulated run through the harness: the record's decode tok/s, hit rate and residency stats."""
    from hydra import compose, initialize_config_dir

    from runners.main import run_job

    with tempfile.TemporaryDirectory() as d:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[*overrides, "mode=simulate", "run.resume=false",
                                               f"run.index_path={d}/index.jsonl"])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            (rec,) = run_job(cfg, Path(d))  # its table and progress bar, once per run, would drown ours
    if rec["status"] != "ok":
        raise RuntimeError(f"{overrides}: {rec['status']}: {rec.get('reason')}")
    ex = rec["stats"]["executor"]
    timing = clock.take() if clock is not None else {}
    return {**timing, "decode_tok_s": rec["metrics"]["decode_tok_s"], "ttft_s": rec["stats"]["ttft_s"],
            "hit_rate": ex["gpu_hit_rate"], "residency": ex.get("residency"),
            "h2d_gb": ex["bytes_h2d_weights"] / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", type=Path, default=INSTRUCT,
                    help="a folder of popularity profiles (one per subject), or none: the model's own for both")
    ap.add_argument("--model", default="mixtral_8x7b")
    ap.add_argument("--envs", nargs="+", default=["rtx4090", "rtx3060"])
    ap.add_argument("--policies", nargs="+", default=["lfu", "lru"])
    ap.add_argument("--reuse", type=float, default=0.0)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="beam width (rows per decode step)")
    ap.add_argument("--same-only", action="store_true", help="only the no-shift pairs")
    ap.add_argument("--limit", type=int, default=0, help="first N pairs only (a quick look)")
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    ap.add_argument("--time-planner", action="store_true", help="time the planner and the residency step per "
                                                                 "layer call (this host's CPU)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    clock = PlannerClock() if a.time_planner else None

    if str(a.profiles) == "none":  # the model's own profile (its reference, else uniform) for both: no shift
        subjects, pairs = [], [(None, None)]
    else:
        subjects = sorted(p.stem for p in a.profiles.glob("*.json"))
        pairs = [(s, s) for s in subjects] if a.same_only else list(itertools.permutations(subjects, 2))
    pairs = pairs[:a.limit] if a.limit else pairs
    workload = ["workload=beam" if a.batch > 1 else "workload=single_batch", f"workload.input_lens=[{a.input_len}]",
                f"workload.output_lens=[{a.output_len}]", f"workload.beam_widths=[{a.batch}]"]
    a.out.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.time()
    with open(a.out / "pairs.jsonl", "w") as f:
        for env, (place, route) in itertools.product(a.envs, pairs):
            def prof(key, subject):
                return [f"{key}={a.profiles / subject}.json"] if subject else []

            common = [f"model={a.model}", f"environment={env}", *workload, f"sim.reuse={a.reuse}",
                      *prof("sim.profile", route), "system=fiddler", *a.extra]
            runs = {"static": prof("system.popularity_profile", place),
                    "oracle": prof("system.popularity_profile", route),
                    **{p: [*prof("system.popularity_profile", place), f"system.residency={p}"] for p in a.policies}}
            res = {name: run_point(common + ov, clock) for name, ov in runs.items()}
            gap = res["oracle"]["decode_tok_s"] - res["static"]["decode_tok_s"]
            for name, r in res.items():
                row = {"env": env, "place": place, "route": route, "policy": name, **r,
                       "vs_static": r["decode_tok_s"] / res["static"]["decode_tok_s"],
                       "gap_closed": (r["decode_tok_s"] - res["static"]["decode_tok_s"]) / gap if gap > 0 else None}
                rows.append(row)
                f.write(json.dumps(row) + "\n")
            print(f"[{time.time() - t0:6.0f}s] {env} {place} -> {route}: " + "  ".join(
                f"{n} {r['decode_tok_s']:.3f} ({r['hit_rate']:.3f})" for n, r in res.items()), flush=True)
    summary = summarise(rows, a)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


def summarise(rows: list[dict], a) -> dict:
    from fiddler.hardware import cpu_name

    out = {"host_cpu": cpu_name() if a.time_planner else None, "model": a.model,
           "profiles": str(a.profiles.relative_to(ROOT) if a.profiles.is_relative_to(ROOT) else a.profiles),
           "reuse": a.reuse, "input_len": a.input_len, "output_len": a.output_len, "batch": a.batch,
           "numbers": "simulated (mode=simulate, the environment's hardware spec)", "by_env": {}}
    for env in a.envs:
        e = {}
        for pol in ["static", "oracle", *a.policies]:
            rs = [r for r in rows if r["env"] == env and r["policy"] == pol]
            if not rs:
                continue
            closed = [r["gap_closed"] for r in rs if r["gap_closed"] is not None]
            e[pol] = {"pairs": len(rs),
                      "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                      "median_hit_rate": statistics.median(r["hit_rate"] for r in rs),
                      "median_gap_closed": statistics.median(closed) if closed else None,
                      "pairs_with_a_gap": len(closed),
                      "min_vs_static": min(r["vs_static"] for r in rs),
                      "median_vs_static": statistics.median(r["vs_static"] for r in rs)}
            if "planner_us" in rs[0]:
                e[pol]["planner_us_per_layer_call"] = statistics.median(r["planner_us"] for r in rs)
                e[pol]["residency_step_us_per_layer_call"] = statistics.median(r["residency_step_us"] for r in rs)
        out["by_env"][env] = e
    return out


if __name__ == "__main__":
    raise SystemExit(main())
