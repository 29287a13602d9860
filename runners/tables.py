"""Tables from records (pandas): one row per system x model x workload point, llama-bench style
mean +- sd, plus status and reason for rows that did not run. Never built by hand.

Every row says what produced it (`provenance`: measured, emulated or simulated; runners/provenance.py)
and so does the line above the table.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from runners import provenance, records, table_format
from runners.table_format import Col
from runners.records import atomic_write_text

KEYS = ["system", "variant", "model", "workload", "environment", "provenance", "mode", "input", "output", "beam",
        "streams", "rate"]
# serving records (workload=serving, runners/serving/workload.py): these columns, vLLM's definitions, in the table when any
# row has them
SERVING = [("max_rate_scaled_slo", "max rate scaled SLO req/s", 3), ("max_rate_mlperf_slo", "max rate MLPerf SLO req/s", 3),
           ("requests", "N", 0), ("request_throughput", "req/s", 2), ("output_tok_s", "out tok/s", 1), ("goodput", "goodput req/s", 2),
           *((f"ttft_p{q}_s", f"TTFT p{q} s", 3) for q in (50, 90, 99)),
           *((f"tpot_p{q}_s", f"TPOT p{q} ms", 1) for q in (50, 90, 99)),
           ("e2e_latency_p50_s", "e2e p50 s", 2), ("e2e_latency_p99_s", "e2e p99 s", 2),
           # per-token latency from aiperf's per-event times, N the gaps; then the server's own histogram's
           *((f"itl_p{q}_s", f"ITL p{q} ms", 1) for q in (50, 90, 99)), ("itl_n", "ITL N", 0),
           *((f"itl_server_p{q}_s", f"server ITL p{q} ms", 1) for q in (50, 90, 99)), ("itl_server_n", "server ITL N", 0),
           ("load_generator_cpu_s", "loadgen CPU s", 1)]
METRICS = [("ttft_s", "TTFT s", 3), ("prefill_tok_s", "prefill tok/s", 1),
           ("decode_tok_s", "decode tok/s", 2), ("e2e_tok_s", "e2e tok/s", 2)]


# config keys that never distinguish two rows of a table
_NOT_VARIANT = ("run.", "cache_dir", "workload.input_lens", "workload.output_lens", "workload.beam_widths",
                "workload.concurrency", "system.adapter", "system.name", "model.path", "serve.")


# what environment=local measures or reads at start (conf/environment/local.yaml): it differs from run to run
# of the same configuration (a bandwidth probe's reading), so it is not a variant there; on a described
# environment the same keys are the spec, and an override of one is a variant
_DETECTED = ("environment.cpu.mem_bandwidth_gbps", "environment.gpu.mem_bandwidth_gbps", "environment.pcie.",
             "environment.host_memory_gb", "environment.source")


def _detected(rec: dict[str, Any]) -> bool:
    env = (rec.get("config") or {}).get("environment") or {}
    return env.get("described") is False


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix[:-1]: json.dumps(d) if isinstance(d, list) else d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def variants(recs: list[dict[str, Any]]) -> list[str]:
    """Per record, the config overrides that distinguish it from other records of the same
    system/model/workload/environment (e.g. `planner=paper` in a planner sweep); '' when none."""
    flats = [{k: v for k, v in _flat(r.get("config") or {}).items()
              if not k.startswith(_NOT_VARIANT) and not (_detected(r) and k.startswith(_DETECTED))} for r in recs]
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(recs):
        groups.setdefault(tuple(r.get(k) for k in ("system", "model", "workload", "environment")), []).append(i)
    out = [""] * len(recs)
    for idx in groups.values():
        keys = sorted({k for i in idx for k in flats[i]})
        varying = [k for k in keys if len({json.dumps(flats[i].get(k), default=str) for i in idx}) > 1]
        for i in idx:
            out[i] = ",".join(f"{k.removeprefix('system.')}={flats[i].get(k)}" for k in varying)
    return out


def frame(recs: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Flat numeric frame: one row per record, metric means, sds and bests as columns."""
    recs = list(recs)
    rows = []
    for r, variant in zip(recs, variants(recs)):
        p = r.get("point", {})
        row = {"system": r.get("system"), "model": r.get("model"), "workload": r.get("workload"),
               "environment": r.get("environment"), "variant": variant, "mode": r.get("mode"),
               "provenance": provenance.of_record(r),
               "host_cpu": (r.get("host") or {}).get("cpu_name"),
               "input": p.get("input_len"),
               "output": p.get("output_len"), "beam": p.get("beam_width"), "streams": p.get("concurrency"),
               "rate": p.get("rate"),
               "status": r.get("status"),
               "reason": r.get("reason"), "time": r.get("time"), "run_id": r.get("run_id")}
        m = r.get("metrics") or {}
        for key, _, _ in METRICS:
            row[key] = m.get(key)
            row[f"{key}_sd"] = m.get(f"{key}_sd")
            row[f"{key}_best"] = (m.get("best") or {}).get(key)
        for key, _, _ in SERVING:
            row[key] = m.get(key)
        row["decode_bound_fraction_best"] = ((r.get("decode_bound") or {}).get("fraction") or {}).get("best")
        ex = (r.get("stats") or {}).get("executor") or {}
        if isinstance(ex, dict) and ex.get("residency"):  # Fiddler's GPU side: resident hits, and fills if it adapts
            row["gpu_hit_rate"] = ex.get("gpu_hit_rate")
            row["evictions"] = ex["residency"].get("evictions")
        row["reps"] = m.get("repetitions")
        row["valid"] = m.get("valid")
        rows.append(row)
    return pd.DataFrame(rows)


def build(recs: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """The latest record per configuration, sorted for reading."""
    return latest(frame(recs))


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """`build` of a `frame` (which may carry columns of its own): the latest row per configuration (KEYS)."""
    if df.empty:
        return df
    df = df.sort_values("time", kind="stable").drop_duplicates(KEYS, keep="last")
    return df.sort_values(["model", "workload", "environment", "input", "output", "beam", "streams", "rate", "system"],
                          kind="stable", na_position="first").reset_index(drop=True)


def columns(df: pd.DataFrame) -> list[Col]:
    """The printed table's columns (runners/table_format.py lifts the constant ones into a header line):
    the keys, then each metric as mean (± sd where a row has repetitions), serving metrics where any row has
    them, the best of the repetitions where any row has more than one, and the decode bound."""
    cols = [Col(k, KEY_TITLES.get(k, k), 0 if k in INT_KEYS else None) for k in KEYS]
    cols.append(Col("status", "status"))
    # at least three significant digits at the column's median (a tiny model's 0.00912 s TTFT is not 0.009)
    cols += [Col(key, title, max(digits, _auto(df, key)), sd=f"{key}_sd") for key, title, digits in METRICS]
    cols += [Col(key, title, digits, scale=1000 if title.endswith(" ms") else 1) for key, title, digits in SERVING]
    # acceptance targets on noisy machines are stated as best of the repetitions; with one they are the mean
    if len(df) and pd.to_numeric(df["reps"], errors="coerce").fillna(1).max() > 1:
        cols += [Col("decode_tok_s_best", "best decode tok/s", 2), Col("prefill_tok_s_best", "best prefill tok/s", 1)]
    # best decode tok/s over the host's decode bound (runners/decode_bound.py), for CPU runs
    # Fiddler's resident set (fiddler.residency): the share of routed tokens its GPU experts served, and the
    # experts it swapped where it adapts
    cols += [c for c in (Col("gpu_hit_rate", "GPU hit", 3), Col("evictions", "fills", 0))
             if c.key in df.columns and df[c.key].notna().any()]
    cols += [Col("decode_bound_fraction_best", "best decode / bound", 2), Col("reps", "reps", 0),
             Col("valid", "valid"), Col("reason", "reason")]
    return cols


def _auto(df: pd.DataFrame, key: str) -> int:
    return (table_format.auto_digits(df[key]) or 0) if key in df.columns else 0


KEY_TITLES = {"provenance": "numbers"}
INT_KEYS = ("input", "output", "beam", "streams")


def display(df: pd.DataFrame) -> pd.DataFrame:
    """The printed table's cells as text, every column (none lifted): for callers that want the frame."""
    out = pd.DataFrame({c.title: [table_format.cell(r, c, "reps") for r in df.to_dict(orient="records")]
                        for c in columns(df) if c.key in df.columns})
    return out


def header(df: pd.DataFrame) -> str:
    """One line saying what the numbers are: each provenance present, and the CPU of measured rows."""
    parts = []
    for label in provenance.LABELS:
        rows = df[df["provenance"] == label]
        if rows.empty:
            continue
        text = f"{label.upper()}: {provenance.MEANING[label]}"
        if label != provenance.SIMULATED:
            cpus = sorted({str(c) for c in rows["host_cpu"] if c is not None and not pd.isna(c)})
            if cpus:
                text += f" ({', '.join(cpus)})"
        parts.append(f"{text} ({len(rows)} rows)")
    return "Numbers: " + "; ".join(parts)


def to_markdown(df: pd.DataFrame) -> str:
    if df.empty:
        return "(no records)"
    shown = df.assign(reason=[" ".join(str(r).split())[:80] if table_format.present(r) else None
                              for r in df["reason"]])
    return table_format.render(shown, columns(df), head=[header(df)], reps="reps")


# ------------------------------------------------------------------------------------------ selection, pivot
FILTERS = ("system", "model", "workload", "environment", "mode", "status")


def select(recs: Iterable[dict[str, Any]], since: str | None = None, until: str | None = None,
           **allowed: Iterable[str] | None) -> list[dict[str, Any]]:
    """The records whose FILTERS fields are among `allowed[field]` (None: any) and whose time lies in
    [since, until], compared as times (ISO dates or times; without an offset, UTC, as records are written; a date
    covers that whole day, so `until=2026-12-01` keeps all of it). A record whose time is not one is left out
    by either bound. ValueError for a bound that is not an ISO date or time."""
    lo = _bound("--since", since, end=False)
    hi = _bound("--until", until, end=True)
    out = []
    for r in recs:
        if any(values is not None and str(r.get(k)) not in set(map(str, values)) for k, values in allowed.items()):
            continue
        if lo is not None or hi is not None:
            t = _time(r.get("time"))
            if t is None or (lo is not None and t < lo) or (hi is not None and t > hi):
                continue
        out.append(r)
    return out


def _time(value: Any) -> _dt.datetime | None:
    """An ISO time as an aware datetime (UTC when it names no offset), None when it is not one."""
    try:
        t = _dt.datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)


def _bound(flag: str, value: str | None, end: bool) -> _dt.datetime | None:
    if value is None:
        return None
    try:  # a date alone: its first instant, or (as an end) its last
        day = _dt.date.fromisoformat(value)
        t = _dt.datetime.combine(day, _dt.time.max if end else _dt.time.min, _dt.timezone.utc)
    except ValueError:
        t = _time(value)
    if t is None:
        raise ValueError(f"{flag} {value!r} is not an ISO date or time (e.g. 2026-12-01 or 2026-12-01T10:00+02:00)")
    return t


def higher_is_better(metric: str) -> bool:
    """tok/s, requests/s and goodput: higher is better; times (TTFT, TPOT, latency): lower."""
    return metric.endswith("tok_s") or metric in ("request_throughput", "goodput") or metric.startswith("max_rate")


def metric_col(metric: str, title: str | None = None) -> Col:
    for key, name, digits in METRICS + SERVING:
        if key == metric:
            return Col(metric, title or name, digits, scale=1000 if name.endswith(" ms") else 1)
    return Col(metric, title or metric, 3)


def pivot(df: pd.DataFrame, key: str = "system", metric: str = "e2e_tok_s",
          baseline: str | None = None) -> tuple[pd.DataFrame, list[Col]]:
    """One row per configuration without `key`, one column per value of `key` (a system with a variant is
    `system [variant]`): the metric where the record is ok, its status where not. With `baseline`, a speedup
    column per other value over it (tok/s: value / baseline; times: baseline / value). Provenance stays in the
    row's key, so simulated and measured numbers never share a row."""
    if key not in KEYS:
        raise ValueError(f"cannot pivot on {key!r}: one of {', '.join(KEYS)}")
    if metric not in df.columns:
        raise ValueError(f"unknown metric {metric!r}")
    labels = [(f"{r[key]} [{r['variant']}]" if key == "system" and r["variant"] else str(r[key]))
              for _, r in df.iterrows()]
    df = df.assign(_col=labels)
    order = list(dict.fromkeys(labels))
    if baseline is not None and baseline not in order:
        raise ValueError(f"baseline {baseline!r} is not among the pivoted {key}s: {', '.join(order)}")
    rows_key = [k for k in KEYS if k != key and not (key == "system" and k == "variant")]
    rows = []
    for cfg, g in df.groupby(rows_key, sort=False, dropna=False):
        row = dict(zip(rows_key, cfg))
        for _, r in g.iterrows():
            row[r["_col"]] = r[metric] if r["status"] == "ok" else r["status"]
        rows.append(row)
    out = pd.DataFrame(rows)
    cols = [Col(k, KEY_TITLES.get(k, k), 0 if k in INT_KEYS else None) for k in rows_key]
    base = metric_col(metric)
    cols += [Col(c, c, base.digits, scale=base.scale) for c in order]
    if baseline is not None:
        for c in order:
            if c == baseline:
                continue
            out[f"{c} / {baseline}"] = [_speedup(v, b, higher_is_better(metric))
                                        for v, b in zip(out.get(c, [None] * len(out)), out[baseline])]
            cols.append(Col(f"{c} / {baseline}", f"{c} / {baseline}", 2, suffix="x"))
    return out, cols


def _speedup(value: Any, base: Any, higher: bool) -> float | None:
    try:
        v, b = float(value), float(base)
    except (TypeError, ValueError):
        return None  # a status, or missing
    if not (v > 0 and b > 0):
        return None
    return v / b if higher else b / v


def save(df: pd.DataFrame, directory: Path) -> None:
    directory = Path(directory)
    atomic_write_text(directory / "table.md", to_markdown(df) + "\n")
    atomic_write_text(directory / "table.csv", df.to_csv(index=False))


USAGE = """Rebuild a table from any set of records: JSONL files (records.jsonl, the project index) or
directories holding them (searched recursively).

    python -m runners.tables results/index.jsonl
    python -m runners.tables results/multirun/2026-11-29 --out /tmp/table --system fiddler llama_cpp
    python -m runners.tables results/index.jsonl --workload beam --since 2026-12-01 --format csv
    python -m runners.tables results/index.jsonl --pivot system --baseline llama_cpp --metric decode_tok_s

Filters (--system, --model, --workload, --environment, --mode, --status: any of the values given;
--since/--until: the record's time, an ISO date or time, compared as times, UTC where no offset is given)
apply before the latest record per configuration is taken. --format md (default) prints the table as Markdown
with constant columns lifted into a header line; csv, json and jsonl print every column's raw values. --pivot
KEY puts KEY's values (usually system) in columns, one metric (--metric, default e2e_tok_s), and --baseline
NAME adds each one's speedup over NAME.

Damaged lines (any bytes that are not a usable record: not UTF-8, not JSON, the wrong shape, `ok`
without metrics) are reported on stderr with file and line number and skipped, never silently dropped.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="records.jsonl / index files or directories")
    ap.add_argument("--out", help="directory to write table.md and table.csv into")
    for key in FILTERS:
        ap.add_argument(f"--{key}", nargs="+", metavar=key.upper(), help=f"only these {key} values")
    ap.add_argument("--since", help="only records at or after this time (ISO date or time)")
    ap.add_argument("--until", help="only records at or before this time (a date includes that whole day)")
    ap.add_argument("--format", choices=table_format.FORMATS, default="md")
    ap.add_argument("--pivot", choices=KEYS, help="this key's values as columns (e.g. system)")
    ap.add_argument("--metric", default="e2e_tok_s", help="the metric of a pivoted table (default: %(default)s)")
    ap.add_argument("--baseline", help="with --pivot: add each column's speedup over this one")
    args = ap.parse_args(argv)
    if args.baseline and not args.pivot:
        ap.error("--baseline needs --pivot")
    try:
        recs = records.collect(args.paths)
    except OSError as exc:  # a missing path, or a file that cannot be read
        raise SystemExit(f"error: {exc}") from None
    try:
        recs = select(recs, since=args.since, until=args.until, **{k: getattr(args, k) for k in FILTERS})
    except ValueError as exc:  # a --since/--until that is no time
        ap.error(str(exc))
    table = build(recs)
    if args.pivot:
        if table.empty:
            print("(no records)")
            return 0
        try:
            frame, cols = pivot(table, args.pivot, args.metric, args.baseline)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        what = f"{args.metric} per {args.pivot}" + (f", speedup over {args.baseline}" if args.baseline else "")
        print(table_format.render(frame, cols, fmt=args.format,
                                  head=[header(table), what] if args.format == "md" else ()))
    elif args.format == "md":
        print(to_markdown(table))
    else:
        print(table_format.render(table, [table_format.Col(c, c) for c in table.columns], fmt=args.format))
    if args.out:
        save(table, Path(args.out))
    return 0


if __name__ == "__main__":  # python -m runners.tables
    sys.exit(main())
