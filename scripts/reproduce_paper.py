"""Reproduce the Fiddler paper's tables without its hardware: run the three paper experiments and the
ablations in simulate mode, the simulator's validation, and write results/paper/.

    python scripts/reproduce_paper.py                 # everything (a few minutes on 2 cores)
    python scripts/reproduce_paper.py --out /tmp/p    # somewhere else
    python scripts/reproduce_paper.py --skip-validation --skip-ablations
    python scripts/reproduce_paper.py --validate-host  # validation (1) also executes on this host (measured)

Each experiment is `python run.py -m +experiment=paper_<workload>` (conf/experiment/), run into a
scratch directory with a fresh index, so earlier records never leak in. The outputs are a function of
the records only (runners/paper.py): no dates, paths or versions, fixed seeds, PNGs without metadata;
two runs give byte-identical files, and the committed results/paper/ is exactly what this writes.
Progress goes to stderr; the exit status is 1 when a sweep or the validation failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402

from runners import paper  # noqa: E402
from runners.records import atomic_write_text, collect  # noqa: E402

REPORTED = ROOT / "results" / "reference" / "paper" / "paper-reported.csv"
EXPERIMENTS = ("paper_single_batch", "paper_long_prefill", "paper_beam")
# the cell of the paper's Fig. 4, where the ablations are measured
FIG4 = ["workload=single_batch", "workload.input_lens=[32]", "workload.output_lens=[256]"]


@dataclass(frozen=True)
class Sweep:
    """One `run.py -m` invocation: the experiment it builds on and the overrides that sweep it."""

    name: str
    overrides: tuple[str, ...]
    what: str = ""


@dataclass
class Ablation:
    name: str
    title: str
    sweep: Sweep
    vary: str  # the config key whose values are compared (read from each record's config)
    note: str = ""
    extra: dict = field(default_factory=dict)


def ablations() -> list[Ablation]:
    envs = "environment=rtx3060,rtx4090,paper_env1,paper_env2"
    return [
        Ablation("placement", "Popularity vs random placement (Fiddler, paper planner)",
                 Sweep("ablation_placement", ("+experiment=paper_single_batch", *FIG4, envs, "system=fiddler_paper",
                                              "system.placement=popularity,random")),
                 "system.placement",
                 "GPU hit rate = share of routed (token, expert) pairs served by an expert resident on the GPU."),
        Ablation("overlap", "With and without CPU/GPU overlap (Fiddler, paper planner)",
                 Sweep("ablation_overlap", ("+experiment=paper_single_batch", *FIG4, envs, "system=fiddler_paper",
                                            "system.overlap=true,false")),
                 "system.overlap",
                 "overlap=false runs each layer's CPU experts first and its GPU experts after them (no concurrency);"
                 " true is the executor's default, CPU and GPU at the same time."),
        Ablation("budget", "GPU budget from 0 to every expert resident (Fiddler, paper planner, rtx4090)",
                 Sweep("ablation_budget", ("+experiment=paper_single_batch", *FIG4, "environment=rtx4090",
                                           "system=fiddler_paper",
                                           "environment.gpu.memory_gb=0,8,16,24,32,48,64,80,96,104")),
                 "environment.gpu.memory_gb",
                 "Budgets above the RTX 4090's 24 GB are beyond the card's real memory (an override of "
                 "environment.gpu.memory_gb, simulated): they show where the curve goes as experts become resident."),
    ]


# the routing's temporal-reuse parameter (sim.reuse; default 0.26, calibrated in fiddler/sim/routing.py to
# Mixtral-Offloading's LRU hit rates as summarised second-hand): the Fig. 4 cell for every system, so the
# speedups the tables state can be seen moving with it
REUSE_VALUES = (0.0, 0.13, 0.26, 0.4, 0.6)
REUSE_SWEEP = Sweep("ablation_reuse", ("+experiment=paper_single_batch", *FIG4,
                                       f"sim.reuse={','.join(str(v) for v in REUSE_VALUES)}"))


def run_sweep(sweep: Sweep, work: Path, log, reuse: bool = False) -> tuple[list[dict], int]:
    """Runs the sweep into work/<name> with its own index; returns its records and run.py's exit status."""
    out = work / sweep.name
    if reuse:
        return collect([out]), 0
    cmd = [sys.executable, "run.py", "-m", *sweep.overrides, f"hydra.sweep.dir={out}",
           f"run.index_path={work / 'index.jsonl'}", "run.resume=false"]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # tables and per-job output go to the log; the progress bars (stderr) to the terminal
    rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=sys.stderr, env=env).returncode
    recs = collect([out]) if out.exists() else []
    return recs, rc


def _progress(step: int, total: int, text: str) -> None:
    print(f"[{step}/{total}] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ outputs
def write_outputs(recs: list[dict], ablation_recs: dict[str, list[dict]], out: Path) -> dict[str, str]:
    """Every file of results/paper/ except validation.md, as {name: text or bytes path}."""
    reported = paper.load_reported(REPORTED)
    df = paper.frame(recs)
    files: dict[str, str] = {}
    for wl, fig in paper.FIGURES.items():
        files[f"{wl}.md"] = paper.figure_markdown(df, fig, reported)
        files[f"{wl}.csv"] = paper.to_csv(paper.figure_long(df, fig, reported))
        paper.plot_figure(df, fig, out / f"{wl}.png")
    md, cells = paper.speedup_markdown(df, reported)
    files["speedups.md"] = md
    files["speedups.csv"] = paper.to_csv(cells)
    files["planner.md"], files["planner.csv"] = planner_ablation(df)
    for ab in ablations():
        text, frame = generic_ablation(ab, ablation_recs.get(ab.name, []))
        files[f"ablation_{ab.name}.md"] = text
        files[f"ablation_{ab.name}.csv"] = paper.to_csv(frame)
        if ab.name == "budget" and len(frame):
            ok = frame[frame["status"] == "ok"]
            paper.plot_series(ok, "memory_gb", ["e2e_tok_s"], ab.title, "GPU budget (GB)", "tok/s",
                              out / "ablation_budget.png", "simulated")
    if "reuse" in ablation_recs:
        files["ablation_reuse.md"], files["ablation_reuse.csv"] = reuse_ablation(ablation_recs["reuse"])
    files["summary.md"] = summary_markdown(df, reported)
    return files


def _config_value(rec: dict, dotted: str):
    node = rec.get("config") or {}
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def generic_ablation(ab: Ablation, recs: list[dict]) -> tuple[str, pd.DataFrame]:
    rows = []
    latest = {}
    for r in sorted(recs, key=lambda r: str(r.get("time") or "")):  # a re-run replaces an earlier record
        latest[(r.get("environment"), r.get("system"), json.dumps(_config_value(r, ab.vary)))] = r
    for r in latest.values():
        f = paper.frame([r])
        if f.empty:
            continue
        row = f.iloc[0].to_dict()
        value = _config_value(r, ab.vary)
        row = {"environment": row["environment"], ab.vary.split(".")[-1]: value,
               "status": row["status"], "e2e_tok_s": row["e2e_tok_s"], "ttft_s": row["ttft_s"],
               "decode_tok_s": row["decode_tok_s"], "gpu_hit_rate": row["gpu_hit_rate"],
               "provenance": row["provenance"]}
        if ab.name == "budget":  # the simulator states how the budget relates to the card's memory
            budget = (r.get("environment_info") or {}).get("gpu_budget") or {}
            card = budget.get("card_memory_gb")
            row["budget_vs_card"] = (f"{budget['override']} ({card:g} GB): an override" if budget.get("override")
                                     else f"the card's {card:g} GB or less" if card else "")
        rows.append(row)
    key = ab.vary.split(".")[-1]
    frame = pd.DataFrame(rows)
    if len(frame):
        order = {e: i for i, e in enumerate(paper.ENVIRONMENTS)}
        frame = frame.assign(_e=[order.get(e, 99) for e in frame["environment"]],
                             _k=[str(v) if not isinstance(v, (int, float)) else f"{float(v):012.3f}"
                                 for v in frame[key]])
        frame = frame.sort_values(["_e", "_k"], kind="stable").drop(columns=["_e", "_k"]).reset_index(drop=True)
    lines = [f"# Ablation: {ab.title}", "", paper.header(frame) if len(frame) else "Numbers: none", "",
             "Mixtral-8x7B, input 32, output 256 (the cell of the paper's Fig. 4), greedy.", ""]
    if ab.note:
        lines += [ab.note, ""]
    cols = ["environment", key, "e2e tok/s", "decode tok/s", "TTFT s", "GPU hit rate", "numbers"]
    if ab.name == "budget":
        cols.insert(2, "budget vs the card")
    lines += ["| " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * (len(cols) - 3) + "---|"]
    for _, r in frame.iterrows():
        vals = [r["environment"], str(r[key])]
        if ab.name == "budget":
            vals.append(r["budget_vs_card"])
        if r["status"] != "ok":
            vals += [r["status"], "", "", ""]
        else:
            vals += [paper.fmt(r["e2e_tok_s"]), paper.fmt(r["decode_tok_s"]), paper.fmt(r["ttft_s"], 3),
                     paper.fmt(r["gpu_hit_rate"], 3)]
        vals.append(r["provenance"])
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n", frame


def reuse_ablation(recs: list[dict]) -> tuple[str, str]:
    """The Fig. 4 cell of every system at each value of sim.reuse, and Fiddler's speedup over the best
    baseline there: how the tables move when the routing's reuse parameter moves."""
    by_reuse: dict[float, list[dict]] = {}
    for r in recs:
        by_reuse.setdefault(float(_config_value(r, "sim.reuse")), []).append(r)
    fig = paper.FIGURES["single_batch"]
    rows = []
    for reuse in sorted(by_reuse):
        df = paper.frame(by_reuse[reuse])
        sp = paper.speedups(df, fig)
        for env in paper._order(df["environment"], paper.ENVIRONMENTS):
            row = {"reuse": reuse, "environment": env}
            for system in paper._order(df["system"], paper.SYSTEMS):
                hit = df[(df["environment"] == env) & (df["system"] == system) & (df["status"] == "ok")]
                row[system] = float(hit["e2e_tok_s"].iloc[0]) if len(hit) else None
                if system == "mixtral_offloading_original" and len(hit):
                    row["mixtral_offloading_gpu_hit_rate"] = hit["gpu_hit_rate"].iloc[0]
            best = sp[(sp["environment"] == env) & sp["best_baseline"]] if len(sp) else sp
            row["speedup_vs_best_baseline"] = float(best["speedup"].iloc[0]) if len(best) else None
            row["best_baseline"] = best["baseline"].iloc[0] if len(best) else None
            rows.append(row)
    frame = pd.DataFrame(rows)
    all_recs = paper.frame(recs)
    lines = ["# Ablation: the routing's temporal-reuse parameter (sim.reuse)", "",
             paper.header(all_recs) if len(all_recs) else "Numbers: none", "",
             "Mixtral-8x7B, input 32, output 256 (the cell of the paper's Fig. 4), greedy, every system. `sim.reuse` is "
             "the probability that each of the previous token's experts is kept for the next token (fiddler/sim/"
             "routing.py). Its default, 0.26, puts an LRU cache of 2/3/4 experts per layer at 40/50/60% hits on the "
             "real Mixtral-8x7B profiles: the band the Mixtral-Offloading paper (arXiv 2312.17238, Fig. 2) reports, "
             "as summarised second-hand. Fiddler's placement is static, so reuse moves mainly the LRU baselines "
             "(the hit rate column is Mixtral-Offloading as its authors' code runs).", ""]
    if len(frame):
        systems = [s for s in paper.SYSTEMS if s in frame.columns]
        cols = ["reuse", "environment"] + [paper.SYSTEMS[s] for s in systems] + \
            ["Mixtral-Offloading GPU hit rate", "Fiddler / best baseline", "best baseline"]
        lines += ["| " + " | ".join(cols) + " |", "|---:|---|" + "---:|" * (len(cols) - 3) + "---|"]
        for _, r in frame.iterrows():
            vals = [f"{r['reuse']:g}", r["environment"]] + [paper.fmt(r[s]) for s in systems]
            vals += [paper.fmt(r.get("mixtral_offloading_gpu_hit_rate"), 3), paper._x(r["speedup_vs_best_baseline"]),
                     paper.SYSTEMS.get(r["best_baseline"], "") if isinstance(r["best_baseline"], str) else ""]
            lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n", paper.to_csv(frame)


def planner_ablation(df: pd.DataFrame) -> tuple[str, str]:
    """The paper's rule vs the makespan planner, from the experiments' own rows (both ran every cell)."""
    rows = []
    for wl, fig in paper.FIGURES.items():
        sub = df[(df["workload"] == wl) & (df["status"] == "ok")]
        for env in paper._order(sub["environment"], paper.ENVIRONMENTS):
            e = sub[sub["environment"] == env]
            ratios = []
            for cell in paper._cells(e, fig):
                a = paper._select(e, env, "fiddler_paper", cell)
                b = paper._select(e, env, "fiddler", cell)
                if len(a) and len(b):
                    va, vb = float(a[fig.metric].iloc[0]), float(b[fig.metric].iloc[0])
                    ratios.append(vb / va if fig.higher_is_better else va / vb)
            if ratios:
                rows.append({"workload": wl, "environment": env, "cells": len(ratios),
                             "mean_makespan_over_paper": sum(ratios) / len(ratios),
                             "min": min(ratios), "max": max(ratios)})
    frame = pd.DataFrame(rows)
    lines = ["# Ablation: the paper's planning rule vs the makespan planner (Fiddler)", "", paper.header(df), "",
             "Speedup of the makespan planner over the paper's rule in every cell of the three experiments "
             "(tok/s ratio; TTFT: inverse ratio); same placement, same routing.", "",
             "| workload | environment | cells | mean | min | max |", "|---|---|---:|---:|---:|---:|"]
    for _, r in frame.iterrows():
        lines.append(f"| {r['workload']} | {r['environment']} | {r['cells']} | {r['mean_makespan_over_paper']:.3f}x"
                     f" | {r['min']:.3f}x | {r['max']:.3f}x |")
    return "\n".join(lines) + "\n", paper.to_csv(frame)


def summary_markdown(df: pd.DataFrame, reported) -> str:
    lines = ["# Fiddler paper reproduction (simulated)", "", paper.header(df), "",
             "Fiddler (the paper's planner) over the baselines, summarised the paper's way: the mean over cells "
             "of Fiddler's speedup over the best of llama.cpp, Mixtral-Offloading and DeepSpeed-MII in each cell "
             "(beam search: over llama.cpp, as the paper states it). Cells: every input x output (single batch), "
             "input length (TTFT) or beam width, on each environment of the scope.", "",
             "| workload | scope | summary | simulated | paper |", "|---|---|---|---:|---:|"]
    for r in paper.headline(df, reported):
        lines.append(f"| {r['workload']} | {r['scope']} | {r['summary']} | {paper._x(r['simulated'])} | "
                     f"{paper._x(r['paper'])} |")
    lines += ["", "Files: `single_batch.*`, `long_prefill.*`, `beam.*` (the figures: Markdown, CSV, PNG), "
              "`speedups.*` (per cell and summaries), `planner.*` and `ablation_*.*` (ablations), "
              "`validation.md` (the simulator against measurements and the paper). Written by "
              "`python scripts/reproduce_paper.py`; do not edit by hand.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "paper"), help="output directory (default: %(default)s)")
    ap.add_argument("--work", help="scratch directory for the sweeps' records (default: a temporary one, removed)")
    ap.add_argument("--skip-ablations", action="store_true")
    ap.add_argument("--skip-validation", action="store_true")
    ap.add_argument("--validate-host", action="store_true",
                    help="validation (1) also executes small_mixtral on this host now (measured: not byte-identical)")
    ap.add_argument("--from-work", action="store_true",
                    help="re-render from the records an earlier run left in --work (runs no sweep)")
    args = ap.parse_args(argv)
    if args.from_work and not args.work:
        ap.error("--from-work needs --work DIR")
    out = Path(args.out)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="reproduce_paper_"))
    work.mkdir(parents=True, exist_ok=True)
    abl = [] if args.skip_ablations else ablations()
    total = len(EXPERIMENTS) + len(abl) + (0 if args.skip_ablations else 1) + (0 if args.skip_validation else 1) + 1
    step = 0
    failed = []
    start = time.perf_counter()
    try:
        with open(work / "run.log", "a") as log:
            recs = []
            for exp in EXPERIMENTS:
                step += 1
                _progress(step, total, f"experiment {exp} (python run.py -m +experiment={exp})")
                got, rc = run_sweep(Sweep(exp, (f"+experiment={exp}",)), work, log, args.from_work)
                recs += got
                if rc != 0:
                    failed.append(f"{exp}: run.py exited {rc}")
            ablation_recs = {}
            for ab in abl:
                step += 1
                _progress(step, total, f"ablation {ab.name}")
                got, rc = run_sweep(ab.sweep, work, log, args.from_work)
                ablation_recs[ab.name] = got
                if rc != 0:
                    failed.append(f"ablation {ab.name}: run.py exited {rc}")
            if not args.skip_ablations:
                step += 1
                _progress(step, total, "ablation reuse (the routing's temporal-reuse parameter, every system)")
                got, rc = run_sweep(REUSE_SWEEP, work, log, args.from_work)
                ablation_recs["reuse"] = got
                if rc != 0:
                    failed.append(f"ablation reuse: run.py exited {rc}")
        staging = Path(tempfile.mkdtemp(prefix="paper_out_", dir=work))
        if not args.skip_validation:
            step += 1
            _progress(step, total, "validation (python -m runners.validate_sim)")
            ok = write_validation(staging / "validation.md", args.validate_host)
            if not ok:
                failed.append("validation: a bound was not met (named above and in validation.md; every file was written)")
        step += 1
        _progress(step, total, f"tables and plots -> {out}")
        files = write_outputs(recs, ablation_recs, staging)
        for name, text in files.items():
            atomic_write_text(staging / name, text if text.endswith("\n") else text + "\n")
        publish(staging, out, keep_validation=args.skip_validation)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"done in {time.perf_counter() - start:.0f} s: {out}", file=sys.stderr)
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


def write_validation(path: Path, live_host: bool) -> bool:
    """The simulator's validation (1)-(3): `python -m runners.validate_sim`. Without `live_host`, check (1)
    uses the committed execute records of this host class (deterministic); with it, small_mixtral is also
    executed here now (measured, so validation.md then differs from run to run). True when it passed."""
    cmd = [sys.executable, "-m", "runners.validate_sim", "--out", str(path)] + ([] if live_host else ["--no-host"])
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode == 0


def publish(staging: Path, out: Path, keep_validation: bool) -> None:
    """Make `out` hold exactly the files written now (stale files of an earlier layout removed)."""
    out.mkdir(parents=True, exist_ok=True)
    written = {p.name for p in staging.iterdir() if p.is_file()}
    for p in out.iterdir():
        if p.is_file() and p.name not in written and not (keep_validation and p.name == "validation.md"):
            p.unlink()
    for name in sorted(written):
        shutil.copyfile(staging / name, out / name)


if __name__ == "__main__":
    sys.exit(main())
