"""The Fiddler paper's tables and figures from records (scripts/reproduce_paper.py writes them to
results/paper/): tok/s per input x output, TTFT per input length, beam tok/s per width, per system and
environment; Fiddler's speedup over each baseline per cell and the paper's summary (the mean over cells
of the speedup over the best baseline); the paper's reported values beside ours; plots in its style.

Everything here is a pure function of the records and the reference CSV: no clock, no paths, fixed
ordering and formatting, so the same records give byte-identical files.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from runners import provenance, table_format
from runners.table_format import Col
from systems.registry import system_classes

# The rows of the paper's tables and figures are the systems whose config class has a `paper_row`
# (systems/base.py): the systems as the paper ran them first (Fiddler's released code, the 2024 llama.cpp,
# Mixtral-Offloading's released code, DeepSpeed ZeRO-Inference), then today's rows; labels, roles and the
# paper's own names are the classes' too.
_ROWS = sorted((c for c in system_classes().values() if c.paper_row is not None), key=lambda c: c.paper_row)
#: rows the paper did not have (marked † in every table)
NOT_IN_PAPER = tuple(c.system_name() for c in _ROWS if c.paper_name is None)
MARK_NOTE = "† = a row the paper did not have (this project's engine or today's systems)."
# llama.cpp 2024's beam cost at the two bounds of the beams' common prefix: rows of llama_cpp_original's
# beam_prefix option (scripts/reproduce_paper.py PREFIX_BOUNDS), not systems of their own
PREFIX_ROWS = {"llama_cpp_original_prefix_prompt": "llama.cpp (2024), prefix = prompt only",
               "llama_cpp_original_prefix_all_but_last": "llama.cpp (2024), prefix = all but last"}
SYSTEMS: dict[str, str] = {**{c.system_name(): c.row_label() + (" †" if c.paper_name is None else "") for c in _ROWS},
                           **PREFIX_ROWS}
# how paper-reported.csv names our rows
PAPER_NAMES = {c.system_name(): c.paper_name for c in _ROWS if c.paper_name is not None}
(FIDDLER,) = (name for name, paper_name in PAPER_NAMES.items() if paper_name == "fiddler")
FIDDLERS = tuple(c.system_name() for c in _ROWS if c.paper_role == "fiddler")
# the paper's three baselines as it ran them: llama.cpp (2024), Mixtral-Offloading's released code, ZeRO-Inference
PAPER_BASELINES = tuple(c.system_name() for c in _ROWS if c.paper_role == "baseline" and c.paper_name is not None)
# today's baselines (the "Today" part of summary.md): the rows the paper lacks, then the paper's baselines that
# still run today's code (ZeRO-Inference)
TODAY_BASELINES = tuple(c.system_name() for c in sorted(_ROWS, key=lambda c: c.paper_name is not None)
                        if c.paper_role == "baseline" and c.today)
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
    """The row a record belongs to: its system, a preset by its own name (`fiddler_original`). A base system
    whose options make a preset's row (records written before presets carried their names, or a preset's
    option given as an override) maps to that row; llama.cpp 2024's beam-prefix bounds get rows of their own."""
    name = rec.get("system")
    options = (rec.get("config") or {}).get("system") or {}
    if name == "fiddler":
        if options.get("original"):
            return "fiddler_original"
        return "fiddler_paper" if options.get("planner") == "paper" else "fiddler"
    if name == "llama_cpp_original" or (name == "llama_cpp" and options.get("original")):
        prefix = options.get("beam_prefix") or "measured"
        return "llama_cpp_original" if prefix == "measured" else f"llama_cpp_original_prefix_{prefix}"
    if name == "llama_cpp":
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
            "model": r.get("model"),
            "input": p.get("input_len"), "output": p.get("output_len"), "beam": p.get("beam_width"),
            "status": r.get("status"), "reason": r.get("reason"), "provenance": provenance.of_record(r),
            "e2e_tok_s": m.get("e2e_tok_s"), "ttft_s": m.get("ttft_s"), "decode_tok_s": m.get("decode_tok_s"),
            "gpu_hit_rate": stats.get("gpu_hit_rate"), "time": r.get("time") or "",
        })
    df = pd.DataFrame(rows, columns=["workload", "environment", "system", "model", "input", "output", "beam", "status",
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
    model = _model(sub)
    out = [f"# {fig.title}: {fig.unit}{', ' + model if model else ''}", "", header(sub), "", MARK_NOTE, ""]
    if long.empty:
        return "\n".join(out + ["(no records)", ""])
    systems = _order(long["system"], SYSTEMS)
    for env in _order(long["environment"], ENVIRONMENTS):
        e = long[long["environment"] == env]
        rows = []
        for cell in _cells(e, fig):
            hit = e[[all(row[k] == v for k, v in cell.items()) for _, row in e.iterrows()]]
            row: dict[str, Any] = dict(cell)
            for s in systems:
                r = hit[hit["system"] == s]
                if len(r):
                    row[s] = r[fig.metric].iloc[0] if r["status"].iloc[0] == "ok" else r["status"].iloc[0]
            row["numbers"] = _label_of(hit[hit["provenance"] != ""])
            rows.append(row)
        cols = [Col(k, k, 0) for k in fig.cell] + [Col(s, SYSTEMS.get(s, s), fig.digits) for s in systems]
        out += [f"## {env}", "", table_format.render(pd.DataFrame(rows), cols + [Col("numbers", "numbers")]), ""]
    cmp = long[long[f"paper_{fig.metric}"].notna()]
    if len(cmp):
        cols = [Col("environment", "environment"), *(Col(k, k, 0) for k in fig.cell), Col("label", "system"),
                Col(fig.metric, f"ours ({fig.unit})", fig.digits), Col(f"paper_{fig.metric}", f"paper ({fig.unit})", 2),
                Col("ratio_to_paper", "ours / paper", 2), Col("provenance", "numbers")]
        out += ["## Compared with the paper", "",
                "Where the paper reports a value (results/reference/paper/paper-reported.csv); ratio = ours / "
                "the paper's.", "", table_format.render(cmp, cols, lift=False), ""]
    return "\n".join(out)


def _model(sub: pd.DataFrame) -> str:
    from runners import figures  # names only; matplotlib is imported when drawing

    return figures.model_name(sub["model"]) if "model" in sub and len(sub) else ""


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
            cols = [Col("scope", "scope", lift=False), Col("cells", "cells", 0, lift=False),
                    Col("vs_best_baseline", "vs best baseline", 2, "x", lift=False)]
            cols += [Col(f"vs_{b}", f"vs {SYSTEMS.get(b, b)}", 2, "x", lift=False) for b in baselines]
            out += [table_format.render(pd.DataFrame(rows), cols), ""]
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
    """CSV with a fixed float format (the same bytes for the same numbers): table_format's, with a final
    newline."""
    return table_format.machine(df, "csv") + "\n"


# ------------------------------------------------------------------------------------------ figures
REPORTED_NOTE = "hollow markers: the paper's reported values (results/reference/paper/paper-reported.csv)"


def _provenance_caption(sub: pd.DataFrame) -> str:
    label = _label_of(sub)
    if label == provenance.SIMULATED:
        return "SIMULATED from each environment's hardware spec (mode=simulate; no hardware ran)"
    return label.upper()


def _positions(cells: list[dict[str, int]], fig: Figure) -> tuple[list[float], list[str], list[tuple[float, str]]]:
    """x positions of the cells, their tick labels and group labels: one key is the x value itself; two keys
    (input x output) are groups of the first key, a gap between groups."""
    if len(fig.cell) == 1:
        return [float(c[fig.cell[0]]) for c in cells], [str(c[fig.cell[0]]) for c in cells], []
    xs, ticks, groups, group, x = [], [], [], None, -1.0
    for c in cells:
        if c[fig.cell[0]] != group:
            group = c[fig.cell[0]]
            x += 1.6 if xs else 1.0
            groups.append((x, f"{fig.cell[0]} {group}"))
        else:
            x += 1.0
        xs.append(x)
        ticks.append(str(c[fig.cell[1]]))
    # a group label centred under its cells
    centred = []
    for k, (start, lab) in enumerate(groups):
        end = (groups[k + 1][0] - 1.6) if k + 1 < len(groups) else xs[-1]
        centred.append(((start + end) / 2, lab))
    return xs, ticks, centred


def plot_figure(df: pd.DataFrame, fig: Figure, stem: Path, reported: pd.DataFrame | None = None) -> list[Path]:
    """One panel per environment: each system's value per cell as points joined by lines (a gap where a cell
    is missing, named in the panel), the paper's reported values as hollow markers. Written as PNG, PDF and
    SVG (runners/figures.py)."""
    from runners import figures

    plt = figures.pyplot()
    sub = df[df["workload"] == fig.workload]
    envs = _order(sub["environment"], ENVIRONMENTS)
    if not envs:
        return []
    systems = _order(sub["system"], SYSTEMS)
    color = dict(zip(systems, figures.colors(len(systems))))
    marker = {s: figures.MARKERS[i % len(figures.MARKERS)] for i, s in enumerate(systems)}
    # two keys (input x output: 16 cells) take the full width, one panel per row; one key, two panels a row
    ncols = 1 if len(fig.cell) > 1 or len(envs) == 1 else 2
    nrows = (len(envs) + ncols - 1) // ncols
    f, axes = plt.subplots(nrows, ncols, figsize=(7.2, (2.3 if ncols == 1 else 2.7) * nrows), squeeze=False)
    any_reported = False
    for ax, env in zip(axes.flat, envs):
        e = sub[sub["environment"] == env]
        cells = _cells(e, fig)
        xs, ticks, groups = _positions(cells, fig)
        values, missing = [], {}
        for s in systems:
            ys = []
            for cell in cells:
                hit = _select(e, env, s, cell)
                ok = len(hit) and hit["status"].iloc[0] == "ok" and _ok(hit[fig.metric].iloc[0])
                ys.append(float(hit[fig.metric].iloc[0]) if ok else math.nan)
            if all(math.isnan(y) for y in ys):
                if (e["system"] == s).any():  # a system with no record here was not part of this panel's runs
                    missing[SYSTEMS.get(s, s)] = len(cells)
                continue
            if any(math.isnan(y) for y in ys):
                missing[SYSTEMS.get(s, s)] = sum(math.isnan(y) for y in ys)
            # lines join cells of one group only (input 32's outputs, not input 32 to input 64)
            line_x, line_y = [], []
            for k, (x, y) in enumerate(zip(xs, ys)):
                if k and len(fig.cell) > 1 and cells[k][fig.cell[0]] != cells[k - 1][fig.cell[0]]:
                    line_x.append(math.nan)
                    line_y.append(math.nan)
                line_x.append(x)
                line_y.append(y)
            ax.plot(line_x, line_y, marker=marker[s], color=color[s], label=SYSTEMS.get(s, s),
                    linestyle="--" if s.startswith("llama_cpp_original_prefix_") else "-")
            values += [y for y in ys if not math.isnan(y)]
            if reported is not None and s in PAPER_NAMES:
                for x, cell in zip(xs, cells):
                    v = reported_cell(reported, fig.workload, env, PAPER_NAMES[s], cell, fig.metric)
                    if v is not None:
                        ax.plot([x], [v], marker=marker[s], markersize=8, markerfacecolor="none",
                                markeredgecolor=color[s], markeredgewidth=1.2, linestyle="none")
                        values.append(v)
                        any_reported = True
        figures.set_value_axis(ax, values)
        if len(fig.cell) > 1:
            ax.set_xticks(xs)
            ax.set_xticklabels(ticks)
            ax.set_xlabel(f"{figures.axis_label(fig.cell[1])}, grouped by {figures.axis_label(fig.cell[0])}")
            for x, lab in groups:
                ax.text(x, 1.0, lab, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7)
        else:
            figures.set_key_axis(ax, xs)
            ax.set_xlabel(figures.axis_label(fig.cell[0]))
        ax.set_ylabel(figures.axis_label(fig.metric))
        ax.set_title(figures.titled(env, missing, len(cells), _reasons(e)), pad=12 if groups else 4)
    for ax in list(axes.flat)[len(envs):]:
        ax.axis("off")
    model = figures.model_name(sub["model"]) if "model" in sub else ""
    f.suptitle(figures.fill(f"{fig.title}{', ' + model if model else ''}", 90) + "\n"
               + _provenance_caption(sub), fontsize=9)
    f.tight_layout()
    notes = [MARK_NOTE] + ([REPORTED_NOTE] if any_reported else [])
    figures.legend_below(f, list(axes.flat), notes, ncol=3, order=[SYSTEMS.get(s, s) for s in systems])
    return figures.save(f, stem)


def _reasons(e: pd.DataFrame) -> dict[str, str]:
    """Why a system has no value in a panel: its records' status (e.g. skipped), by label."""
    out = {}
    for s, g in e[e["status"] != "ok"].groupby("system", sort=False):
        out[SYSTEMS.get(s, s)] = "/".join(sorted(set(g["status"].astype(str))))
    return out


def parity_points(df: pd.DataFrame, reported: pd.DataFrame | None) -> pd.DataFrame:
    """Every value the paper reports beside ours: the per-cell values (Fig. 4) and the three summaries (the
    released Fiddler over the paper's baselines, as the paper ran them)."""
    rows = []
    if reported is None:
        return pd.DataFrame(rows)
    ours = {v: k for k, v in PAPER_NAMES.items()}
    for _, r in reported.iterrows():
        wl = r["workload"]
        if wl not in FIGURES:
            continue
        fig = FIGURES[wl]
        if r["environment"] == "all":
            if r["metric"] != fig.paper_summary:
                continue
            hit = [h for h in headline(df, reported, 0) if h["workload"] == wl and h["scope"] == "paper_env1 + paper_env2"]
            value = hit[0]["simulated"] if hit else None
            rows.append({"kind": "summary", "workload": wl, "environment": "paper_env1 + paper_env2",
                         "system": FIDDLER, "what": f"{wl}: {hit[0]['summary'] if hit else ''}", "paper": r["value"],
                         "ours": value})
            continue
        if r["metric"] != fig.metric or r["system"] not in ours:
            continue
        system = ours[r["system"]]
        cell = {k: r[col] for k, col in (("input", "input_len"), ("output", "output_len"), ("beam", "beam_width"))
                if k in fig.cell}
        hit = _select(df[(df["workload"] == wl) & (df["status"] == "ok")], r["environment"], system, cell)
        rows.append({"kind": "cell", "workload": wl, "environment": r["environment"], "system": system,
                     "what": ", ".join(f"{k} {v}" for k, v in cell.items()), "paper": r["value"],
                     "ours": float(hit[fig.metric].iloc[0]) if len(hit) else None})
    return pd.DataFrame(rows)


def plot_parity(df: pd.DataFrame, reported: pd.DataFrame | None, stem: Path) -> list[Path]:
    """Ours (simulated) against the paper's reported value for every value it reports: the Fig. 4 cells
    (tok/s) and the three headline speedups, on log-log axes with y = x and a 10% band."""
    from runners import figures

    pts = parity_points(df, reported)
    if pts.empty:
        return []
    plt = figures.pyplot()
    f, axes = plt.subplots(1, 2, figsize=(7.4, 3.5))
    env_marker = {e: figures.MARKERS[i] for i, e in enumerate(ENVIRONMENTS + ("paper_env1 + paper_env2",))}
    systems = _order(pts["system"], SYSTEMS)
    color = dict(zip(systems, figures.colors(len(systems))))
    for ax, kind, unit in ((axes[0], "cell", "end-to-end throughput (tok/s)"),
                           (axes[1], "summary", "Fiddler's mean speedup (x)")):
        p = pts[(pts["kind"] == kind) & pts["ours"].notna()]
        lost = pts[(pts["kind"] == kind) & pts["ours"].isna()]
        vals = list(p["paper"]) + list(p["ours"])
        if not vals:
            ax.axis("off")
            continue
        lo, hi = min(vals) / 1.6, max(vals) * 1.6
        ax.plot([lo, hi], [lo, hi], color="0.3", linewidth=0.8)
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.85", linewidth=0)
        for _, r in p.iterrows():
            label = SYSTEMS.get(r["system"], r["system"]) if kind == "cell" else None
            ax.plot([r["paper"]], [r["ours"]], marker=env_marker.get(r["environment"], "o"), linestyle="none",
                    color=color[r["system"]], label=label, markersize=5)
            if kind == "summary":
                ax.annotate(r["workload"].replace("_", " "), (r["paper"], r["ours"]), textcoords="offset points",
                            xytext=(5, -3), fontsize=7)
        for ax_ in (ax,):
            ax_.set_xscale("log")
            ax_.set_yscale("log")
            for axis in (ax_.xaxis, ax_.yaxis):
                import matplotlib.ticker as mt

                axis.set_major_locator(mt.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                axis.set_major_formatter(mt.FuncFormatter(lambda v, _: f"{v:g}"))
                axis.set_minor_formatter(mt.NullFormatter())
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_aspect("equal")
        ax.set_xlabel(f"the paper's value: {unit}")
        ax.set_ylabel(f"simulated: {unit}")
        title = "Fig. 4 cells (input 32, output 256)" if kind == "cell" else "headline speedups, as the paper ran them"
        ax.set_title(f"{title} ({len(p)} values)")
        if len(lost):
            ax.text(0.02, 0.98, "not simulated: " + ", ".join(lost["what"]), transform=ax.transAxes, va="top",
                    fontsize=6)
    # environments by marker, in the legend too
    for e in ("paper_env1", "paper_env2"):
        axes[0].plot([], [], marker=env_marker[e], color="0.4", linestyle="none", label=e)
    f.suptitle("Simulated against the paper's reported values (grey band: within 10%)\n"
               + _provenance_caption(df), fontsize=9)
    f.tight_layout()
    figures.legend_below(f, [axes[0]], ["right panel: paper_env1 + paper_env2 together; beam search is over "
                                        "llama.cpp (2024) at the measured common prefix"], ncol=3)
    return figures.save(f, stem)


def plot_budget(frame: pd.DataFrame, title: str, stem: Path) -> list[Path]:
    """The budget ablation: tok/s against the GPU budget per environment, the card's real memory marked."""
    from runners import figures

    ok = frame[frame["status"] == "ok"] if len(frame) else frame
    if ok.empty:
        return []
    plt = figures.pyplot()
    f, ax = plt.subplots(figsize=(5.2, 3.0))
    envs = _order(ok["environment"], ENVIRONMENTS)
    for env, c in zip(envs, figures.colors(len(envs))):
        e = ok[ok["environment"] == env].sort_values("memory_gb")
        ax.plot(e["memory_gb"], e["e2e_tok_s"], marker="o", color=c, label=env)
        cards = [v for v in e.get("card_memory_gb", []) if _ok(v)]
        if cards:
            ax.axvline(cards[0], color=c, linestyle=":", linewidth=1)
            ax.text(cards[0], 0.98, f" {env}'s real {cards[0]:g} GB", transform=ax.get_xaxis_transform(),
                    ha="left", va="top", fontsize=7, color=c)
    figures.set_value_axis(ax, ok["e2e_tok_s"])
    ax.set_xlabel(figures.axis_label("memory_gb"))
    ax.set_ylabel(figures.axis_label("e2e_tok_s"))
    if len(envs) > 1:
        ax.legend()
    ax.set_title(figures.fill(title, 95) + "\n" + _provenance_caption(ok), fontsize=8)
    f.tight_layout()
    return figures.save(f, stem)
