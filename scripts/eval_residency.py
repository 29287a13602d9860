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
    ap.add_argument("--report-only", action="store_true", help="rewrite table.md and figure.* from <out>'s pairs")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.report_only:
        rows = [json.loads(line) for line in (a.out / "pairs.jsonl").read_text().splitlines()]
        a.envs = list(dict.fromkeys(r["env"] for r in rows))
        report(a.out, rows, json.loads((a.out / "summary.json").read_text()))
        return 0
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
    report(a.out, rows, summary)
    print(json.dumps(summary, indent=1))
    return 0


ABBREV = {"college_computer_science": "CS", "college_medicine": "Med", "high_school_biology": "Bio",
          "high_school_mathematics": "Math", "high_school_us_history": "Hist", "international_law": "Law",
          "machine_learning": "ML"}


def report(out: Path, rows: list[dict], summary: dict) -> None:
    """table.md (every pair: decode tok/s and hit rate by policy, the share of the gap closed) and figure.*
    (per environment: decode tok/s over mismatched static's and the hit rate, pairs sorted by the oracle's gap)."""
    from matplotlib.ticker import MaxNLocator

    from runners.figures import colors, legend_below, pyplot, save

    envs = list(summary["by_env"])
    pols = [p for p in ["static", "oracle", "lfu", "lru"] if any(r["policy"] == p for r in rows)]
    adaptive = [p for p in pols if p not in ("static", "oracle")]
    name = lambda s: ABBREV.get(s, s) if s else "own"  # noqa: E731
    lines = [f"Simulated (mode=simulate, the environment's hardware spec): {summary['model']}, "
             f"{summary['input_len']} in / {summary['output_len']} out, batch {summary['batch']}, "
             f"sim.reuse={summary['reuse']}; profiles {summary['profiles']}. Decode tok/s (GPU hit rate); "
             "'closed' is the share of the gap from mismatched static to the oracle static that the policy closes.", ""]
    for env in envs:
        lines += [f"### {env}", "", "| place -> route | " + " | ".join(pols) + " | " +
                  " | ".join(f"{p} closed" for p in adaptive) + " |",
                  "|---|" + "---:|" * (len(pols) + len(adaptive))]
        by = {}
        for r in rows:
            if r["env"] == env:
                by.setdefault((r["place"], r["route"]), {})[r["policy"]] = r
        for (pl, rt), d in by.items():
            cells = [f"{d[p]['decode_tok_s']:.3f} ({d[p]['hit_rate']:.3f})" for p in pols]
            closed = [f"{d[p]['gap_closed']:.2f}" if d[p]["gap_closed"] is not None else "-" for p in adaptive]
            lines.append(f"| {name(pl)} -> {name(rt)} | " + " | ".join(cells + closed) + " |")
        e = summary["by_env"][env]
        med = [f"median {e[p]['median_decode_tok_s']:.3f} ({e[p]['median_hit_rate']:.3f})" for p in pols]
        mc = [f"median {e[p]['median_gap_closed']:.2f}" if e[p]["median_gap_closed"] is not None else "-"
              for p in adaptive]
        lines += ["| **all pairs** | " + " | ".join(med + mc) + " |", ""]
    (out / "table.md").write_text("\n".join(lines) + "\n")

    plt = pyplot()
    fig, axes = plt.subplots(2, len(envs), figsize=(3.4 * len(envs), 4.6), squeeze=False)
    cols = dict(zip(pols, colors(len(pols))))
    for j, env in enumerate(envs):
        by = {}
        for r in rows:
            if r["env"] == env:
                by.setdefault((r["place"], r["route"]), {})[r["policy"]] = r
        order = sorted(by, key=lambda k: by[k]["oracle"]["vs_static"])
        xs = list(range(1, len(order) + 1))
        for p in pols:
            axes[0][j].plot(xs, [by[k][p]["vs_static"] for k in order], marker="o", ms=2.5, color=cols[p], label=p)
            axes[1][j].plot(xs, [by[k][p]["hit_rate"] for k in order], marker="o", ms=2.5, color=cols[p], label=p)
        axes[0][j].set_title(f"{env} (simulated)")
        axes[0][j].set_ylabel("decode tok/s / mismatched static")
        axes[1][j].set_ylabel("GPU hit rate")
        axes[1][j].set_xlabel("subject pair, by the oracle's gain")
        for ax in (axes[0][j], axes[1][j]):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    legend_below(fig, axes.ravel().tolist(), [f"{summary['model']}, {summary['input_len']} in, "
                                              f"{summary['output_len']} out, batch {summary['batch']}, "
                                              f"sim.reuse={summary['reuse']}"])
    save(fig, out / "figure")
    plt.close(fig)


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
