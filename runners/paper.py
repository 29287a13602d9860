"""The Fiddler paper's tables and figures from records (scripts/reproduce_paper.py writes them to
results/paper/): tok/s per input x output, TTFT per input length, beam tok/s per width, per system and
environment; Fiddler's speedup over each baseline per cell and the paper's summary (the mean over cells
of the speedup over the best baseline); the paper's reported values beside ours; plots in its style.

Everything here is a pure function of the records and the reference CSV: no clock, no paths, fixed
ordering and formatting, so the same records give byte-identical files.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from runners import provenance

# Rows of the paper's figures, in its order: the systems as the paper ran them first (Fiddler's released code,
# the 2024 llama.cpp, Mixtral-Offloading's released code, DeepSpeed ZeRO-Inference), then today's rows.
SYSTEMS: dict[str, str] = {
    "fiddler_original": "Fiddler",
    "llama_cpp_original": "llama.cpp (2024, llama_beam_search)",
    "mixtral_offloading_original": "Mixtral-Offloading",
    "deepspeed_mii": "DeepSpeed-MII",
    "fiddler_paper": "Fiddler (paper's rule, our engine) †",
    "fiddler": "Fiddler (makespan planner) †",
    "llama_cpp": "llama.cpp (today) †",
    "llama_cpp_cpu_moe": "llama.cpp --n-cpu-moe †",
    "mixtral_offloading": "Mixtral-Offloading (ours, prefetch) †",
    "llama_cpp_original_prefix_prompt": "llama.cpp (2024), prefix = prompt only",
    "llama_cpp_original_prefix_all_but_last": "llama.cpp (2024), prefix = all but last",
}
#: rows the paper did not have (marked † in every table)
NOT_IN_PAPER = ("fiddler_paper", "fiddler", "llama_cpp", "llama_cpp_cpu_moe", "mixtral_offloading")
MARK_NOTE = "† = a row the paper did not have (this project's engine or today's systems)."
FIDDLER = "fiddler_original"
FIDDLERS = ("fiddler_original", "fiddler_paper", "fiddler")
# the paper's three baselines as it ran them: llama.cpp (2024), Mixtral-Offloading's released code, ZeRO-Inference
PAPER_BASELINES = ("llama_cpp_original", "mixtral_offloading_original", "deepspeed_mii")
# today's baselines (the "Today" part of summary.md)
TODAY_BASELINES = ("llama_cpp", "llama_cpp_cpu_moe", "mixtral_offloading", "deepspeed_mii")
# how paper-reported.csv names our rows
PAPER_NAMES = {FIDDLER: "fiddler", "llama_cpp_original": "llama_cpp", "mixtral_offloading_original": "mixtral_offloading",
               "deepspeed_mii": "deepspeed_mii"}
ENVIRONMENTS = ("rtx3060", "rtx4090", "paper_env1", "paper_env2")
PAPER_ENVIRONMENTS = ("paper_env1", "paper_env2")


@dataclass(frozen=True)
class Figure:
    """One of the paper's figures: which workload, which metric, how a cell is keyed."""

    workload: str
    metric: str  # record metric
    title: str
    unit: str
    higher_is_better: bool
    cell: tuple[str, ...]  # point keys that identify a cell
    paper_summary: str  # paper-reported.csv metric of the summary
    digits: int


FIGURES = {
    "single_batch": Figure("single_batch", "e2e_tok_s", "End-to-end throughput, batch 1 (greedy)", "tok/s", True,
                           ("input", "output"), "speedup_vs_best_baseline", 2),
    "long_prefill": Figure("long_prefill", "ttft_s", "Time to first token, long prompts", "s", False,
                           ("input",), "speedup_vs_best_baseline", 2),
    "beam": Figure("beam", "e2e_tok_s", "Beam search throughput (input 32, output 64)", "tok/s", True,
                   ("beam",), "speedup_vs_llama_cpp", 2),
}


def system_key(rec: dict[str, Any]) -> str:
    """The row a record belongs to: the system, told apart by the option that makes a variant."""
    name = rec.get("system")
    options = (rec.get("config") or {}).get("system") or {}
    if name == "fiddler":
        if options.get("original"):
            return "fiddler_original"
        return "fiddler_paper" if options.get("planner") == "paper" else "fiddler"
    if name == "llama_cpp":
        if options.get("original"):
            prefix = options.get("beam_prefix") or "measured"
            return "llama_cpp_original" if prefix == "measured" else f"llama_cpp_original_prefix_{prefix}"
        return "llama_cpp_cpu_moe" if options.get("n_cpu_moe") not in (None, 0) else "llama_cpp"
    if name == "mixtral_offloading" and options.get("original_swap"):
        return "mixtral_offloading_original"
    return str(name)


def frame(recs: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """One row per record: keys, the metrics the figures use, status and provenance."""
    rows = []
    for r in recs:
        p = r.get("point") or {}
        m = r.get("metrics") or {}
        stats = r.get("stats") or {}
        stats = {**stats, **(stats.get("executor") or {})}  # simulated records nest the executor's counters
        rows.append({
            "workload": r.get("workload"), "environment": r.get("environment"), "system": system_key(r),
            "input": p.get("input_len"), "output": p.get("output_len"), "beam": p.get("beam_width"),
            "status": r.get("status"), "reason": r.get("reason"), "provenance": provenance.of_record(r),
            "e2e_tok_s": m.get("e2e_tok_s"), "ttft_s": m.get("ttft_s"), "decode_tok_s": m.get("decode_tok_s"),
            "gpu_hit_rate": stats.get("gpu_hit_rate"), "time": r.get("time") or "",
        })
    df = pd.DataFrame(rows, columns=["workload", "environment", "system", "input", "output", "beam", "status",
                                     "reason", "provenance", "e2e_tok_s", "ttft_s", "decode_tok_s",
                                     "gpu_hit_rate", "time"])
    if df.empty:
        return df
    # the latest record per configuration (a re-run replaces an earlier one)
    df = df.sort_values("time", kind="stable").drop_duplicates(
        ["workload", "environment", "system", "input", "output", "beam"], keep="last")
    return df.drop(columns="time").reset_index(drop=True)


def _ok(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def fmt(value: Any, digits: int = 2) -> str:
    if not _ok(value):
        return ""
    v = float(value)
    if v != 0 and abs(v) < 10 ** -digits:
        return f"{v:.{digits}g}"
    return f"{v:.{digits}f}"


def header(df: pd.DataFrame) -> str:
    """The provenance line every table starts with."""
    labels = [lab for lab in provenance.LABELS if lab in set(df["provenance"])] if not df.empty else []
    if not labels:
        return "Numbers: none"
    return "Numbers: " + "; ".join(f"{lab.upper()}: {provenance.MEANING[lab]}" for lab in labels)


def _label_of(df: pd.DataFrame) -> str:
    labels = sorted(set(df["provenance"]))
    return "/".join(labels) if labels else ""


# ------------------------------------------------------------------------------------------ reference
def load_reported(path: Path) -> pd.DataFrame:
    """results/reference/paper/paper-reported.csv as a frame (values as floats, keys as ints)."""
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    df["value"] = df["value"].astype(float)
    for k in ("input_len", "output_len", "beam_width"):
        df[k] = pd.Series([int(v) if v else None for v in df[k]], index=df.index, dtype=object)
    return df


def reported_cell(reported: pd.DataFrame, workload: str, environment: str, system: str, point: dict,
                  metric: str) -> float | None:
    hit = reported[(reported["workload"] == workload) & (reported["environment"] == environment)
                   & (reported["system"] == system) & (reported["metric"] == metric)]
    for key, col in (("input", "input_len"), ("output", "output_len"), ("beam", "beam_width")):
        if key in point:
            hit = hit[pd.Series([v is None or v == point[key] for v in hit[col]], index=hit.index, dtype=bool)]
    return float(hit["value"].iloc[0]) if len(hit) else None


def reported_summary(reported: pd.DataFrame, workload: str) -> float | None:
    metric = FIGURES[workload].paper_summary
    hit = reported[(reported["workload"] == workload) & (reported["environment"] == "all")
                   & (reported["system"] == "fiddler") & (reported["metric"] == metric)]
    return float(hit["value"].iloc[0]) if len(hit) else None


# ------------------------------------------------------------------------------------------ tables
def figure_long(df: pd.DataFrame, fig: Figure, reported: pd.DataFrame | None) -> pd.DataFrame:
    """The figure's values, one row per environment x cell x system, with the paper's value beside
    ours where it reports one (the ratio is ours / the paper's)."""
    sub = df[df["workload"] == fig.workload]
    rows = []
    for env in _order(sub["environment"], ENVIRONMENTS):
        for cell in _cells(sub[sub["environment"] == env], fig):
            for system in _order(sub["system"], SYSTEMS):
                hit = _select(sub, env, system, cell)
                value = hit[fig.metric].iloc[0] if len(hit) and hit["status"].iloc[0] == "ok" else None
                paper = None
                if reported is not None and system in PAPER_NAMES:
                    paper = reported_cell(reported, fig.workload, env, PAPER_NAMES[system], cell, fig.metric)
                rows.append({"environment": env, **cell, "system": system, "label": SYSTEMS.get(system, system),
                             fig.metric: value, "status": hit["status"].iloc[0] if len(hit) else "missing",
                             "provenance": hit["provenance"].iloc[0] if len(hit) else "",
                             f"paper_{fig.metric}": paper,
                             "ratio_to_paper": value / paper if _ok(value) and paper else None})
    return pd.DataFrame(rows)


def figure_markdown(df: pd.DataFrame, fig: Figure, reported: pd.DataFrame | None) -> str:
    long = figure_long(df, fig, reported)
    sub = df[df["workload"] == fig.workload]
    out = [f"# {fig.title}: {fig.metric} ({fig.unit}), Mixtral-8x7B", "", header(sub), ""]
    if long.empty:
        return "\n".join(out + ["(no records)", ""])
    systems = _order(long["system"], SYSTEMS)
    for env in _order(long["environment"], ENVIRONMENTS):
        e = long[long["environment"] == env]
        out += [f"## {env}", ""]
        cols = list(fig.cell) + [SYSTEMS.get(s, s) for s in systems] + ["numbers"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
        for cell in _cells(e, fig):
            hit = e[[all(row[k] == v for k, v in cell.items()) for _, row in e.iterrows()]]
            cells = [str(cell[k]) for k in fig.cell]
            for s in systems:
                r = hit[hit["system"] == s]
                if not len(r):
                    cells.append("")
                elif r["status"].iloc[0] != "ok":
                    cells.append(str(r["status"].iloc[0]))
                else:
                    cells.append(fmt(r[fig.metric].iloc[0], fig.digits))
            cells.append(_label_of(hit[hit["provenance"] != ""]))
            lines.append("| " + " | ".join(cells) + " |")
        out += lines + [""]
    cmp = long[long[f"paper_{fig.metric}"].notna()]
    if len(cmp):
        out += ["## Compared with the paper", "",
                f"Where the paper reports a value (results/reference/paper/paper-reported.csv); ratio = ours / "
                f"the paper's.", "",
                "| environment | " + " | ".join(fig.cell) + " | system | ours | paper | ratio | numbers |",
                "|---|" + "---:|" * len(fig.cell) + "---|---:|---:|---:|---|"]
        for _, r in cmp.iterrows():
            out.append(f"| {r['environment']} | " + " | ".join(str(r[k]) for k in fig.cell)
                       + f" | {r['label']} | {fmt(r[fig.metric], fig.digits)} | {fmt(r[f'paper_{fig.metric}'], 2)}"
                       f" | {fmt(r['ratio_to_paper'], 2)} | {r['provenance']} |")
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ speedups
def speedups(df: pd.DataFrame, fig: Figure, fiddler: str = FIDDLER,
             best_of: tuple[str, ...] = PAPER_BASELINES) -> pd.DataFrame:
    """Fiddler's speedup over each baseline in every cell where both ran: tok/s ratio, or the inverse
    ratio of TTFT. `best_baseline` marks the baseline the summary uses: the best of `best_of` (the paper's
    three as it ran them, or today's)."""
    sub = df[(df["workload"] == fig.workload) & (df["status"] == "ok")]
    rows = []
    for env in _order(sub["environment"], ENVIRONMENTS):
        e = sub[sub["environment"] == env]
        for cell in _cells(e, fig):
            f = _select(e, env, fiddler, cell)
            if not len(f) or not _ok(f[fig.metric].iloc[0]):
                continue
            fv = float(f[fig.metric].iloc[0])
            base = {}
            for system in _order(e["system"], SYSTEMS):
                if system in FIDDLERS or system.startswith("llama_cpp_original_prefix_"):
                    continue
                b = _select(e, env, system, cell)
                if len(b) and _ok(b[fig.metric].iloc[0]) and float(b[fig.metric].iloc[0]) > 0:
                    base[system] = float(b[fig.metric].iloc[0])
            paper_base = {s: v for s, v in base.items() if s in best_of}
            best = (max if fig.higher_is_better else min)(paper_base, key=paper_base.get) if paper_base else None
            for system, bv in base.items():
                sp = fv / bv if fig.higher_is_better else bv / fv
                rows.append({"environment": env, **cell, "fiddler": fiddler, "baseline": system,
                             f"fiddler_{fig.metric}": fv, f"baseline_{fig.metric}": bv, "speedup": sp,
                             "best_baseline": system == best})
    # no cell where both ran (e.g. a record set without this Fiddler row): still the same columns, so a caller's
    # filter on them selects nothing instead of raising KeyError
    columns = ["environment", *fig.cell, "fiddler", "baseline", f"fiddler_{fig.metric}", f"baseline_{fig.metric}",
               "speedup", "best_baseline"]
    return pd.DataFrame(rows, columns=columns)


def _mean(values) -> float | None:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else None


def summary(sp: pd.DataFrame) -> list[dict[str, Any]]:
    """The paper's summary per scope: mean over cells of the speedup over the best baseline, and the
    mean speedup over each baseline alone."""
    scopes = [(env, (env,)) for env in _order(sp["environment"], ENVIRONMENTS)] if len(sp) else []
    scopes += [("paper_env1 + paper_env2", PAPER_ENVIRONMENTS), ("all four", ENVIRONMENTS)]
    out = []
    for name, envs in scopes:
        s = sp[sp["environment"].isin(envs)] if len(sp) else sp
        if not len(s):
            continue
        row = {"scope": name, "cells": int(s["best_baseline"].sum()),
               "vs_best_baseline": _mean(s[s["best_baseline"]]["speedup"])}
        for b in _order(s["baseline"], SYSTEMS):
            row[f"vs_{b}"] = _mean(s[s["baseline"] == b]["speedup"])
        out.append(row)
    return out


PARTS = (
    ("As the paper ran them", FIDDLER, PAPER_BASELINES, "llama_cpp_original"),
    ("Today", "fiddler", TODAY_BASELINES, "llama_cpp"),
    ("Today, the paper's rule", "fiddler_paper", TODAY_BASELINES, "llama_cpp"),
)


def speedup_markdown(df: pd.DataFrame, reported: pd.DataFrame | None) -> tuple[str, pd.DataFrame]:
    """speedups.md and the per-cell frame behind it (speedups.csv)."""
    out = ["# Fiddler's speedup over the baselines", "", header(df), "",
           "Per cell: Fiddler's tok/s over the baseline's (TTFT: the baseline's over Fiddler's). The paper's "
           "summary is the mean over cells of the speedup over the best of its three baselines in each cell; for "
           "beam search the paper states the mean speedup over llama.cpp. *As the paper ran them*: Fiddler's "
           "released code over llama.cpp (2024), Mixtral-Offloading's released code and DeepSpeed-MII. *Today*: "
           "this project's Fiddler over today's llama.cpp (-ngl and --n-cpu-moe), this project's Mixtral-Offloading "
           "and DeepSpeed-MII. " + MARK_NOTE, ""]
    frames = []
    for wl, fig in FIGURES.items():
        for part, fiddler, best_of, llama in PARTS:
            sp = speedups(df, fig, fiddler, best_of)
            if not len(sp):
                continue
            frames.append(sp.assign(workload=wl, part=part))
            paper = reported_summary(reported, wl) if reported is not None and fiddler == FIDDLER else None
            rows = summary(sp)
            baselines = [c.removeprefix("vs_") for c in rows[0] if c.startswith("vs_") and c != "vs_best_baseline"]
            out += [f"## {fig.title}: {part} ({SYSTEMS[fiddler]})", ""]
            if paper is not None:
                what = "over llama.cpp" if fig.paper_summary == "speedup_vs_llama_cpp" else "over the best baseline"
                out += [f"The paper reports {paper:.2f}x (mean {what}).", ""]
            cols = ["scope", "cells", "vs best baseline"] + [f"vs {SYSTEMS.get(b, b)}" for b in baselines]
            out += ["| " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * (len(cols) - 2)]
            for r in rows:
                vals = [r["scope"], str(r["cells"]), _x(r["vs_best_baseline"])]
                vals += [_x(r.get(f"vs_{b}")) for b in baselines]
                out.append("| " + " | ".join(vals) + " |")
            out.append("")
    cells = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return "\n".join(out), cells


def headline(df: pd.DataFrame, reported: pd.DataFrame | None, part: int = 0) -> list[dict[str, Any]]:
    """Fiddler's mean speedups the paper's way (PARTS[part]: as the paper ran them, or today) next to the
    paper's 1.26x / 1.30x / 11.57x."""
    _, fiddler, best_of, llama = PARTS[part]
    rows = []
    for wl, fig in FIGURES.items():
        sp = speedups(df, fig, fiddler, best_of)
        if not len(sp):
            continue
        by_scope = {r["scope"]: r for r in summary(sp)}
        key = f"vs_{llama}" if fig.paper_summary == "speedup_vs_llama_cpp" else "vs_best_baseline"
        for scope in ("paper_env1 + paper_env2", "all four"):
            r = by_scope.get(scope)
            if r is not None:
                rows.append({"workload": wl, "scope": scope, "cells": r["cells"],
                             "summary": f"over {SYSTEMS[llama]}" if key != "vs_best_baseline" else "over the best baseline",
                             "simulated": r.get(key), "paper": reported_summary(reported, wl)
                             if reported is not None else None})
    return rows


def _x(v) -> str:
    return f"{v:.2f}x" if _ok(v) else ""


# ------------------------------------------------------------------------------------------ helpers
def _order(values, known) -> list:
    present = [v for v in pd.unique(values) if _ok(v)]
    first = [k for k in known if k in present]
    return first + sorted(v for v in present if v not in first)


def _cells(df: pd.DataFrame, fig: Figure) -> list[dict[str, int]]:
    if df.empty:
        return []
    keys = df[list(fig.cell)].dropna().drop_duplicates()
    keys = keys.sort_values(list(fig.cell), kind="stable")
    return [{k: int(row[k]) for k in fig.cell} for _, row in keys.iterrows()]


def _select(df: pd.DataFrame, env: str, system: str, cell: dict[str, int]) -> pd.DataFrame:
    mask = (df["environment"] == env) & (df["system"] == system)
    for k, v in cell.items():
        mask &= df[k] == v
    return df[mask]


def to_csv(df: pd.DataFrame) -> str:
    """CSV with a fixed float format (the same bytes for the same numbers)."""
    buf = io.StringIO()
    df.to_csv(buf, index=False, float_format="%.6g", lineterminator="\n")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ plots
def plot_figure(df: pd.DataFrame, fig: Figure, path: Path) -> None:
    """Grouped bars per environment, one bar per system and cell, in the paper's style; the title says
    what produced the numbers. PNG metadata fixed (no software version or date), so files are reproducible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    sub = df[(df["workload"] == fig.workload) & (df["status"] == "ok")]
    envs = _order(sub["environment"], ENVIRONMENTS)
    systems = _order(sub["system"], SYSTEMS)
    if not envs:
        return
    plt.rcParams.update({"svg.hashsalt": "fiddler", "font.size": 8})
    ncols = 2 if len(envs) > 1 else 1
    nrows = (len(envs) + ncols - 1) // ncols
    f, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 3.0 * nrows), squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, env in zip(axes.flat, envs):
        e = sub[sub["environment"] == env]
        cells = _cells(e, fig)
        width = 0.8 / max(1, len(systems))
        for i, s in enumerate(systems):
            ys = []
            for cell in cells:
                hit = _select(e, env, s, cell)
                ys.append(float(hit[fig.metric].iloc[0]) if len(hit) and _ok(hit[fig.metric].iloc[0]) else 0.0)
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(cells))]
            ax.bar(xs, ys, width, label=SYSTEMS.get(s, s), color=colors(i % 10))
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels(["-".join(str(c[k]) for k in fig.cell) for c in cells], rotation=45 if len(cells) > 6
                           else 0, ha="right" if len(cells) > 6 else "center")
        ax.set_title(env)
        ax.set_ylabel(f"{fig.metric} ({fig.unit})")
        ax.set_xlabel(" x ".join(fig.cell))
        positive = sub[fig.metric][sub[fig.metric] > 0]
        if len(positive) and positive.max() / positive.min() > 20:  # baselines 10-100x apart, as in the paper
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(axis="y", linewidth=0.3)
    for ax in list(axes.flat)[len(envs):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    f.legend(handles, labels, loc="lower center", ncol=len(systems), fontsize=7, frameon=False)
    f.suptitle(f"{fig.title}, Mixtral-8x7B ({_label_of(sub).upper()}: from each environment's hardware spec)"
               if _label_of(sub) == "simulated" else f"{fig.title}, Mixtral-8x7B ({_label_of(sub).upper()})")
    f.tight_layout(rect=(0, 0.05, 1, 1))
    f.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(f)


def plot_series(rows: pd.DataFrame, x: str, ys: list[str], title: str, xlabel: str, ylabel: str, path: Path,
                label: str) -> None:
    """A line plot (ablation sweeps), with the provenance in the title and fixed PNG metadata."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f, ax = plt.subplots(figsize=(6, 3.4))
    for y in ys:
        ax.plot(rows[x], rows[y], marker="o", label=y)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title} ({label.upper()})", fontsize=9)
    ax.grid(linewidth=0.3)
    ax.legend(fontsize=7)
    f.tight_layout()
    f.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(f)
