"""Figures in one style, for the paper's tables (runners/paper.py) and a user's own sweeps (scripts/plot.py).

The rules, in one place:
- points joined by lines, never bars on a log axis; a log axis only where the values span 10x or more;
- axes in words with units (`AXES`); a missing value is a gap, and the panel says which series are missing
  where in the panel's title (`titled`), never a zero;
- reference values (the paper's) as hollow markers of the series' colour beside the filled ones;
- each figure written as PNG (200 dpi), PDF and SVG with fixed metadata (no date, no software version), so
  the same data give the same files.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Sequence

DPI = 200
FORMATS = ("png", "pdf", "svg")
LOG_SPAN = 10.0  # values spanning this factor or more go on a log axis

# what a record's keys and metrics are, in words with units
AXES = {
    "input": "input length (tokens)", "input_len": "input length (tokens)",
    "output": "output length (tokens)", "output_len": "output length (tokens)",
    "beam": "beam width", "beam_width": "beam width",
    "streams": "concurrent streams", "concurrency": "concurrent streams",
    "e2e_tok_s": "end-to-end throughput (tok/s)", "decode_tok_s": "decode throughput (tok/s)",
    "prefill_tok_s": "prefill throughput (tok/s)", "ttft_s": "time to first token (s)",
    "output_tok_s": "output throughput (tok/s)", "request_throughput": "request throughput (req/s)",
    "goodput": "goodput (req/s)", "memory_gb": "GPU memory budget (GB)",
    **{f"ttft_p{q}_s": f"time to first token, p{q} (s)" for q in (50, 90, 99)},
    **{f"tpot_p{q}_s": f"time per output token, p{q} (s)" for q in (50, 90, 99)},
}

# models as papers name them (records carry the config key)
MODEL_NAMES = {
    "mixtral_8x7b": "Mixtral-8x7B", "qwen3_30b_a3b": "Qwen3-30B-A3B", "qwen3_235b_a22b": "Qwen3-235B-A22B",
    "deepseek_v3": "DeepSeek-V3", "deepseek_v2_lite": "DeepSeek-V2-Lite", "olmoe_1b_7b": "OLMoE-1B-7B",
    "small_mixtral": "small Mixtral (generated)", "tiny_mixtral": "tiny Mixtral (generated)",
    "small_qwen3_moe": "small Qwen3-MoE, 30B-A3B-shaped (generated)",
}


def axis_label(key: str) -> str:
    return AXES.get(key, key.replace("_", " "))


def model_name(models: Iterable[Any]) -> str:
    names = sorted({MODEL_NAMES.get(str(m), str(m)) for m in models if m is not None and m == m})
    return ", ".join(names)


def pyplot():
    """matplotlib's pyplot on the Agg backend with this project's style (imported only when drawing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "svg.hashsalt": "fiddler", "svg.fonttype": "path", "pdf.fonttype": 42, "font.size": 8,
        "axes.titlesize": 9, "axes.labelsize": 8, "legend.fontsize": 7, "axes.spines.top": False,
        "axes.spines.right": False, "axes.grid": True, "grid.linewidth": 0.3, "grid.alpha": 0.6,
        "lines.linewidth": 1.2, "lines.markersize": 4,
    })
    return plt


def colors(n: int) -> list:
    """n distinct colours: tab10's, then black and tab10's again (tab20's pale pairs read as one series)."""
    cmap = pyplot().get_cmap("tab10")
    return [cmap(i) if i < 10 else ("black" if i == 10 else cmap(i % 10)) for i in range(n)]


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*")


def span(values: Iterable[Any]) -> float:
    """max / min of the positive finite values (1 when fewer than two)."""
    vals = [float(v) for v in values if v is not None and _finite(v) and float(v) > 0]
    return max(vals) / min(vals) if len(vals) > 1 else 1.0


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def set_value_axis(ax, values: Iterable[Any], axis: str = "y") -> None:
    """Log where the values span LOG_SPAN or more (with labelled 1-2-5 ticks and the values between), linear
    from zero otherwise."""
    import matplotlib.ticker as mt

    values = list(values)
    if span(values) >= LOG_SPAN:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
        target = ax.yaxis if axis == "y" else ax.xaxis
        target.set_major_locator(mt.LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
        target.set_major_formatter(mt.FuncFormatter(lambda v, _: f"{v:g}"))
        target.set_minor_locator(mt.LogLocator(base=10, subs=tuple(range(1, 10))))
        target.set_minor_formatter(mt.NullFormatter())
    else:
        top = max([float(v) for v in values if _finite(v)] or [1.0])
        (ax.set_ylim if axis == "y" else ax.set_xlim)(0, top * 1.12)


def set_key_axis(ax, xs: Sequence[float]) -> None:
    """A numeric key (input length, beam width): log base 2 where it doubles, ticks at the values themselves."""
    import matplotlib.ticker as mt

    xs = sorted({float(x) for x in xs if _finite(x)})
    if len(xs) > 2 and span(xs) >= 8:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(mt.FixedLocator(xs))
    ax.xaxis.set_major_formatter(mt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_locator(mt.NullLocator())


def titled(title: str, missing: dict[str, int], total: int, why: dict[str, str] | None = None) -> str:
    """A panel's title with a second line naming the series that have missing points (a gap alone is easy to
    overlook), and why where the records say (their status)."""
    if not missing:
        return title
    why = why or {}
    parts = [f"{name} ({'all' if n == total else f'{n} of {total}'} {why.get(name, 'missing')})"
             for name, n in missing.items()]
    return title + "\n" + fill("not shown: " + "; ".join(parts), 80)


def fill(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text


def save(fig, stem: Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """The figure as stem.png / .pdf / .svg with fixed metadata; returns the paths written."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    meta = {"png": {"Software": None}, "pdf": {"CreationDate": None, "ModDate": None, "Producer": None,
                                               "Creator": None},
            "svg": {"Date": None, "Creator": None}}
    paths = []
    for ext in formats:
        path = stem.with_suffix(f".{ext}")
        fig.savefig(path, dpi=DPI, metadata=meta[ext], bbox_inches="tight", pad_inches=0.05)
        paths.append(path)
    pyplot().close(fig)
    return paths


def legend_below(fig, axes, notes: Sequence[str] = (), ncol: int | None = None,
                 order: Sequence[str] | None = None) -> None:
    """One legend for all panels, below them, with the notes (what a marker or a dagger means) under it;
    entries in `order` where given (else as first drawn)."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if order is not None:
        rank = {lab: i for i, lab in enumerate(order)}
        seen = dict(sorted(seen.items(), key=lambda kv: rank.get(kv[0], len(rank))))
    if seen:
        fig.legend(list(seen.values()), list(seen.keys()), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=ncol or min(3, len(seen)), frameon=False)
    if notes:
        rows = math.ceil(len(seen) / (ncol or min(3, max(1, len(seen))))) if seen else 0
        # below the legend's rows (about 0.17 in each at its font size), in figure fractions
        y = -(rows * 0.17 + 0.08) / fig.get_size_inches()[1]
        fig.text(0.5, y, "\n".join(notes), ha="center", va="top", fontsize=6.5, color="0.3")


# ------------------------------------------------------------------------------------------ a user's sweep
# a record's point keys as the table frame names them (runners/tables.py)
KEY_ALIASES = {"input_len": "input", "output_len": "output", "beam_width": "beam", "concurrency": "streams"}
SWEEP_KEYS = ("system", "variant", "model", "workload", "environment", "provenance", "mode", "input", "output",
              "beam", "streams")


def sweep_series(df, x: str, y: str, by: Sequence[str] = ("system",)) -> tuple[list[str], dict]:
    """What `sweep` draws: (the keys that make panels, {panel key: {line label: [(x, y), ...]}}) from a table
    frame (runners/tables.build), ok rows only, points sorted by x. Keys that vary besides x and `by` make one
    panel per combination, so no line mixes two configurations; provenance always separates lines (simulated
    and measured numbers are never joined). A missing point is absent, never zero."""
    x = KEY_ALIASES.get(x, x)
    by = [KEY_ALIASES.get(b, b) for b in by]
    for name in [x, y, *by]:
        if name not in df.columns:
            raise ValueError(f"no column {name!r} in these records; columns: {', '.join(map(str, df.columns))}")
    ok = df[(df["status"] == "ok") & df[x].notna() & df[y].notna()]
    if ok.empty:
        raise ValueError(f"no ok record has both {x} and {y}")
    series_keys = list(dict.fromkeys([*by, "provenance"]))
    varying = [k for k in SWEEP_KEYS if k in ok.columns and k != x and k not in series_keys
               and ok[k].astype(str).nunique() > 1]
    panels: dict = {}
    for _, r in ok.sort_values(x, kind="stable").iterrows():
        pkey = tuple(r[k] for k in varying)
        panels.setdefault(pkey, {}).setdefault(_series_label(r, series_keys, ok), []).append((r[x], float(r[y])))
    return varying, dict(sorted(panels.items(), key=lambda kv: tuple(map(str, kv[0]))))


def sweep(df, x: str, y: str, by: Sequence[str] = ("system",), stem: Path | None = None, title: str | None = None,
          formats: Sequence[str] = FORMATS) -> list[Path]:
    """`sweep_series` drawn: one panel per combination of the other varying keys, one line per series, the
    provenance (and the CPU of measured rows) in the title. Returns the files written."""
    import pandas as pd

    varying, panels = sweep_series(df, x, y, by)
    x = KEY_ALIASES.get(x, x)
    ok = df[(df["status"] == "ok") & df[x].notna() & df[y].notna()]
    plt = pyplot()
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 2.9 * nrows), squeeze=False)
    labels = sorted({lab for lines in panels.values() for lab in lines})
    color = dict(zip(labels, colors(len(labels))))
    mark = {lab: MARKERS[i % len(MARKERS)] for i, lab in enumerate(labels)}
    numeric_x = pd.api.types.is_numeric_dtype(ok[x])
    for ax, (pkey, lines) in zip(axes.flat, panels.items()):
        xs_all, ys_all = [], []
        for lab in labels:
            if lab not in lines:
                continue
            xs, ys = zip(*lines[lab])
            ax.plot(list(xs) if numeric_x else list(map(str, xs)), list(ys), marker=mark[lab], color=color[lab],
                    label=lab)
            xs_all += list(xs)
            ys_all += list(ys)
        set_value_axis(ax, ys_all)
        if numeric_x:
            set_key_axis(ax, xs_all)
        ax.set_xlabel(axis_label(x))
        ax.set_ylabel(axis_label(y))
        if varying:
            ax.set_title(", ".join(f"{k} {v}" for k, v in zip(varying, pkey)))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    provs = sorted(set(ok["provenance"]))
    cpus = sorted({str(c) for c in ok.get("host_cpu", []) if c is not None and c == c})
    caption = "; ".join(p.upper() for p in provs) + (f" on {', '.join(cpus)}" if cpus and provs != ["simulated"] else "")
    model = model_name(ok["model"]) if "model" in ok else ""
    fig.suptitle(fill(title or f"{axis_label(y)} by {axis_label(x)}{', ' + model if model else ''}", 90)
                 + f"\n{caption}", fontsize=9)
    fig.tight_layout()
    legend_below(fig, list(axes.flat), ncol=min(3, len(labels)))
    if stem is None:
        plt.close(fig)
        return []
    return save(fig, stem, formats)


def _series_label(row, keys: Sequence[str], df) -> str:
    """The line a row belongs to: its `by` values, with the variant where a system has several and the
    provenance where the records mix them."""
    parts = [str(row[k]) for k in keys if k != "provenance"]
    if "system" in keys and "variant" in df.columns and row.get("variant"):
        parts.append(f"[{row['variant']}]")
    if df["provenance"].nunique() > 1:
        parts.append(f"({row['provenance']})")
    return " ".join(parts)
