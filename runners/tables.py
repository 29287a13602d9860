"""Tables from records (pandas): one row per system x model x workload point, llama-bench style
mean +- sd, plus status and reason for rows that did not run. Never built by hand.

Every row says what produced it (`provenance`: measured, emulated or simulated; runners/provenance.py)
and so does the line above the table.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from runners import provenance
from runners.records import atomic_write_text

KEYS = ["system", "variant", "model", "workload", "environment", "provenance", "mode", "input", "output", "beam",
        "streams"]
# serving records (workload=serving, runners/serving.py): these columns, vLLM's definitions, in the table when any
# row has them
SERVING = [("request_throughput", "req/s", 2), ("output_tok_s", "out tok/s", 1), ("goodput", "goodput req/s", 2),
           *((f"ttft_p{q}_s", f"TTFT p{q} s", 3) for q in (50, 90, 99)),
           *((f"tpot_p{q}_s", f"TPOT p{q} ms", 1) for q in (50, 90, 99)),
           ("e2e_latency_p50_s", "e2e p50 s", 2), ("e2e_latency_p99_s", "e2e p99 s", 2)]
METRICS = [("ttft_s", "TTFT s", 3), ("prefill_tok_s", "prefill tok/s", 1),
           ("decode_tok_s", "decode tok/s", 2), ("e2e_tok_s", "e2e tok/s", 2)]


# config keys that never distinguish two rows of a table
_NOT_VARIANT = ("run.", "cache_dir", "workload.input_lens", "workload.output_lens", "workload.beam_widths",
                "workload.concurrency", "system.adapter", "system.name", "model.path", "serve.")


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
    flats = [{k: v for k, v in _flat(r.get("config") or {}).items() if not k.startswith(_NOT_VARIANT)}
             for r in recs]
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
        row["reps"] = m.get("repetitions")
        row["valid"] = m.get("valid")
        rows.append(row)
    return pd.DataFrame(rows)


def build(recs: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """The latest record per configuration, sorted for reading."""
    df = frame(recs)
    if df.empty:
        return df
    df = df.sort_values("time", kind="stable").drop_duplicates(KEYS, keep="last")
    return df.sort_values(["model", "workload", "environment", "input", "output", "beam", "streams", "system"],
                          kind="stable", na_position="first").reset_index(drop=True)


def _fmt(mean, sd, digits: int) -> str:
    if mean is None or pd.isna(mean):
        return ""
    return f"{mean:.{digits}f} ± {0.0 if sd is None or pd.isna(sd) else sd:.{digits}f}"


def display(df: pd.DataFrame) -> pd.DataFrame:
    serving = df["streams"].notna().any()
    keys = [k for k in KEYS if (k != "variant" or df["variant"].astype(bool).any()) and (k != "streams" or serving)]
    out = df[keys + ["status"]].copy()
    if serving:
        out["streams"] = [("" if v is None or pd.isna(v) else str(int(v))) for v in df["streams"]]
    for key, title, digits in METRICS:
        out[title] = [_fmt(m, s, digits) for m, s in zip(df[key], df[f"{key}_sd"])]
    if serving:  # TPOT shown in ms
        for key, title, digits in SERVING:
            scale = 1000 if title.endswith(" ms") else 1
            out[title] = [("" if v is None or pd.isna(v) else f"{v * scale:.{digits}f}") for v in df[key]]
    # acceptance targets on noisy machines are stated as best of the repetitions
    for key, title in (("decode_tok_s", "best decode tok/s"), ("prefill_tok_s", "best prefill tok/s")):
        out[title] = [("" if v is None or pd.isna(v) else f"{v:.2f}") for v in df[f"{key}_best"]]
    # best decode tok/s over the host's decode bound (runners/decode_bound.py), for CPU runs
    out["best decode / bound"] = [("" if v is None or pd.isna(v) else f"{v:.2f}")
                                  for v in df["decode_bound_fraction_best"]]
    out["reps"] = df["reps"]
    out["valid"] = df["valid"]
    out["reason"] = [("" if r is None or pd.isna(r) else " ".join(str(r).split())[:80]) for r in df["reason"]]
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
    return header(df) + "\n\n" + display(df).to_markdown(index=False)


def save(df: pd.DataFrame, directory: Path) -> None:
    directory = Path(directory)
    atomic_write_text(directory / "table.md", to_markdown(df) + "\n")
    atomic_write_text(directory / "table.csv", df.to_csv(index=False))
