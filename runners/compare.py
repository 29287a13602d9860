"""Two record sets compared configuration by configuration (`python -m runners.compare`, main below, is the command).

A side is a records/index JSONL file, a directory (every records.jsonl below it, as `records.collect`
reads them) or the records committed at a git revision (`REV` or `REV:PATH`: every *.jsonl under PATH,
default `results/`, as `git show REV:file` has it). An existing file or directory always wins over a
revision of the same name.

Each side is reduced to its latest record per configuration (`tables.KEYS`, as `tables.build` does;
provenance is one of the keys, so simulated numbers are never matched with measured or emulated ones:
a configuration that is one on one side and another on the other is a `refused` row). For every
configuration on either side a row gives A's and B's value of the metric, the speedup (B/A for tok/s,
higher is better; A/B for seconds, lower is better: > 1 always means B is faster) and a flag.

The flag is the project's one noise rule, `verdict` (runners/noise.py, as scripts/ab.py uses it), on the per-repetition readings of
the two records (derived from `raw` exactly as runners/measure.py computes the metrics; a derivation
whose mean is not the record's metric is not used). `verdict` wants readings paired by round; the
repetitions of two records were not measured side by side, so repetition i of A is paired with
repetition i of B (both in measurement order, so a warm-up drift within a run falls on both alike),
the first min(n_A, n_B) of each where the counts differ (the row says so). With fewer than 5 pairs the
verdict can never say "changed" (its sign test), and the flag says "too few to tell". Where a side has
one repetition there is no noise estimate; where the readings cannot be derived (no `raw`) the band is
the two sides' relative sds from `metrics` combined, shown as such, and no verdict is given.

The variant key is each side's own (`tables.variants` over that side's records, as its table shows it), so
a side whose records differ in a value detected at start (`environment.cpu.mem_bandwidth_gbps`) splits
into variants the other side may not have: those rows are `only in A` / `only in B`. Narrow such a side
(the files themselves, or --where) to compare it.
"""
from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from runners import tables
from runners.table_format import FORMATS
from runners.records import collect, parse_jsonl, record_problem
from runners.table_format import Col, present, render
from runners.noise import verdict
from runners.records import resolve_rev

DEFAULT_GIT_PATH = "results"
METRICS = {key: (title, digits) for key, title, digits in tables.METRICS}
LOWER_IS_BETTER = ("ttft_s",)

FASTER, SLOWER, NOISE = "B faster", "B slower", "within noise"
ONE_REP, ONLY_A, ONLY_B, REFUSED = "no noise estimate (1 rep)", "only in A", "only in B", "refused"
SD_ONLY, NO_SD = "no verdict (mean ± sd only)", "no noise estimate (no sd)"


class CompareError(Exception):
    """Bad input: the message says why (exit 2)."""


@dataclass
class Side:
    label: str  # the path or the revision as given, with the commit
    records: list[dict[str, Any]]


# ---------------------------------------------------------------- the two sides


def _git(top: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(top), *args], capture_output=True, check=True).stdout


def load(spec: str, repo: Path | str = ".") -> Side:
    """The records of one side (see the module's docstring); CompareError when `spec` names nothing."""
    path = Path(spec)
    if path.exists():
        recs = collect([path])
        if not recs:
            hint = " (below a directory only records.jsonl files are read; name other .jsonl files themselves)" \
                if path.is_dir() else ""
            raise CompareError(f"{spec} holds no usable records{hint}")
        return Side(spec, recs)
    rev, _, sub = spec.partition(":")
    sub = sub or DEFAULT_GIT_PATH
    try:
        top = Path(_git(Path(repo), "rev-parse", "--show-toplevel").decode().strip())
    except (OSError, subprocess.CalledProcessError):
        raise CompareError(f"{spec!r} is neither an existing file or directory nor a git revision ({repo} is "
                           f"in no git repository; --repo names one)") from None
    try:
        sha = resolve_rev(rev, top)
    except ValueError as e:
        raise CompareError(f"{spec!r} is neither an existing file or directory nor a git revision ({e})") from None
    names = [n for n in _git(top, "ls-tree", "-r", "--name-only", sha, "--", sub).decode().splitlines()
             if n.endswith(".jsonl")]
    if not names:
        raise CompareError(f"{rev}:{sub} ({sha[:12]}) holds no committed *.jsonl file")
    recs: list[dict[str, Any]] = []
    for name in sorted(names):
        recs += parse_jsonl(_git(top, "show", f"{sha}:{name}").splitlines(keepends=True), f"{rev}:{name}",
                            check=record_problem)
    if not recs:
        raise CompareError(f"{rev}:{sub} ({sha[:12]}) holds no usable records in its {len(names)} *.jsonl file(s)")
    return Side(f"{rev}:{sub} ({sha[:12]})", recs)


def parse_where(items: Sequence[str]) -> dict[str, str]:
    """`key=value` filters on the table's keys; CompareError for anything else."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in tables.KEYS:
            raise CompareError(f"--where {item!r}: want KEY=VALUE with KEY one of {', '.join(tables.KEYS)}")
        out[key] = value
    return out


# ---------------------------------------------------------------- readings


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def repetitions(rec: dict[str, Any], metric: str) -> tuple[list[float] | None, str]:
    """The metric of each repetition, from `raw` as runners/measure.py's metrics_of computes it, or None
    and why not. Used only when their mean is the record's own metric."""
    raw = rec.get("raw") or {}
    ttft, dec, tok = raw.get("ttft_s"), raw.get("decode_s"), raw.get("tokens")
    if not isinstance(ttft, list) or not ttft or not all(_num(v) for v in ttft):
        return None, "no raw ttft_s"
    if metric == "ttft_s":
        vals = list(ttft)
    elif metric == "prefill_tok_s":
        n_in = (rec.get("point") or {}).get("input_len")
        if not _num(n_in) or not all(t > 0 for t in ttft):
            return None, "no input_len or a zero ttft"
        vals = [n_in / t for t in ttft]
    else:
        if not (isinstance(dec, list) and isinstance(tok, list) and len(dec) == len(tok) == len(ttft)
                and all(_num(v) for v in dec + tok)):
            return None, "no raw decode_s and tokens"
        if metric == "decode_tok_s":  # a repetition of one token, or no decode time, has none (as measured)
            vals = [(k - 1) / d for k, d in zip(tok, dec) if k > 1 and d > 0]
        else:
            vals = [k / (t + d) for k, t, d in zip(tok, ttft, dec) if t + d > 0]
    mean = (rec.get("metrics") or {}).get(metric)
    if not vals or not _num(mean) or not math.isclose(statistics.fmean(vals), mean, rel_tol=1e-6, abs_tol=1e-12):
        return None, f"raw does not give metrics.{metric}"
    return vals, ""


def _reps(rec: dict[str, Any]) -> int:
    n = (rec.get("metrics") or {}).get("repetitions")
    return int(n) if _num(n) else 1


def judge(a: dict[str, Any], b: dict[str, Any], metric: str, tolerance: float = 0.0) -> dict[str, Any]:
    """The flag of two ok records: verdict on their paired repetitions (see the module's docstring)."""
    ra, why_a = repetitions(a, metric)
    rb, why_b = repetitions(b, metric)
    na = len(ra) if ra is not None else _reps(a)
    nb = len(rb) if rb is not None else _reps(b)
    out: dict[str, Any] = {"band": None, "noise_from": None, "why": None, "paired": None, "pairs": None}
    if min(na, nb) < 2:
        return {**out, "flag": ONE_REP, "why": f"A has {na}, B has {nb} repetition(s)"}
    if ra is not None and rb is not None:
        n = min(na, nb)
        v = verdict(ra[:n], rb[:n], tolerance)  # base = A, head = B: its ratios are B/A
        lower = metric in LOWER_IS_BETTER
        if v["changed"]:
            flag = FASTER if (v["direction"] == "lower") == lower else SLOWER
        elif "too few for a sign test" in v["why"]:  # beyond the band, but no sign test can reject with n < 5
            flag = f"{NOISE} ({n} reps: too few to tell)"
        else:
            flag = NOISE
        why = v["why"] + (f"; the first {n} of each paired (A has {na}, B has {nb})" if na != nb else "")
        m = v["median_ratio"]
        paired = (1 / m if m else None) if lower else m
        return {**out, "flag": flag, "band": v["band"], "noise_from": "repetitions", "why": why,
                "paired": paired, "pairs": n}
    sds = [(r.get("metrics") or {}).get(f"{metric}_sd") for r in (a, b)]
    means = [(r.get("metrics") or {}).get(metric) for r in (a, b)]
    missing = _joined(((s, w) for s, w in (("A", why_a), ("B", why_b)) if w), ": ")
    if not all(_num(s) for s in sds) or not all(_num(m) and m for m in means):
        return {**out, "flag": NO_SD, "why": missing}
    band = math.hypot(*(s / abs(m) for s, m in zip(sds, means)))
    return {**out, "flag": SD_ONLY, "band": band, "noise_from": "metrics sd", "why": missing}


# ---------------------------------------------------------------- the rows


def _norm(key: str, value: Any) -> Any:
    if not present(value):
        return None
    return int(value) if key in tables.INT_KEYS else value


def _latest(side: Side, where: dict[str, str]) -> dict[tuple, tuple[dict[str, Any], dict[str, Any]]]:
    """key tuple -> (frame row, record): the latest record per configuration, filtered."""
    df = tables.frame(side.records)
    df["_rec"] = range(len(df))
    df = tables.latest(df)
    out = {}
    for row in df.to_dict(orient="records"):
        key = tuple(_norm(k, row[k]) for k in tables.KEYS)
        named = dict(zip(tables.KEYS, key))
        if all(("" if named[k] is None else str(named[k])) == v for k, v in where.items()):
            out[key] = (row, side.records[row["_rec"]])
    return out


def _value_cells(prefix: str, row: dict[str, Any] | None, metric: str) -> dict[str, Any]:
    if row is None:
        return {}
    reps = int(row["reps"]) if present(row.get("reps")) else None
    ok = row.get("status") == "ok"
    return {f"{prefix}_status": row.get("status"), f"{prefix}_reps": reps if ok else None,
            prefix: row.get(metric) if ok else None,
            f"{prefix}_sd": row.get(f"{metric}_sd") if ok and (reps or 1) > 1 else None,
            f"{prefix}_cpu": row.get("host_cpu") if present(row.get("host_cpu")) else None,
            f"{prefix}_time": row.get("time")}


def _speedup(a: Any, b: Any, metric: str) -> float | None:
    if not (_num(a) and _num(b)):
        return None
    num, den = (a, b) if metric in LOWER_IS_BETTER else (b, a)
    return num / den if den else None


def _reason(row: dict[str, Any]) -> str:
    r = row.get("reason")
    return " ".join(str(r).split())[:80] if present(r) else ""


def _joined(pairs, sep: str = " ") -> str:
    """("A", x), ("B", x) as "A, B{sep}x"; different values as "A{sep}x, B{sep}y"."""
    pairs = list(pairs)
    if len(pairs) == 2 and pairs[0][1] == pairs[1][1]:
        return f"A, B{sep}{pairs[0][1]}"
    return ", ".join(f"{s}{sep}{v}" for s, v in pairs)


def _pair(key: tuple, a: tuple | None, b: tuple | None, metric: str, tolerance: float) -> dict[str, Any]:
    ra, rb = (a[0] if a else None), (b[0] if b else None)
    row: dict[str, Any] = dict(zip(tables.KEYS, key))
    row.update(_value_cells("a", ra, metric))
    row.update(_value_cells("b", rb, metric))
    notes = []
    if ra is None or rb is None:
        row["flag"] = ONLY_B if ra is None else ONLY_A
        row["kind"] = "only_b" if ra is None else "only_a"
        present_side = ("A", ra) if rb is None else ("B", rb)
        row["note"] = f"{present_side[0]}: {_reason(present_side[1])}" if _reason(present_side[1]) else None
        return row
    not_ok = [(s, r) for s, r in (("A", ra), ("B", rb)) if r["status"] != "ok"]
    if not_ok:
        row.update(flag=_joined((s, r["status"]) for s, r in not_ok), kind="not_ok")
        notes.append(_joined(((s, _reason(r)) for s, r in not_ok if _reason(r)), ": "))
    elif not (_num(row.get("a")) and _num(row.get("b"))):
        row.update(flag="no value", kind="no_value")
        notes.append(f"{metric} missing on " + " and ".join(s for s in "ab" if not _num(row.get(s))).upper())
    else:
        row["speedup"] = _speedup(row["a"], row["b"], metric)
        j = judge(a[1], b[1], metric, tolerance)
        band = j["band"] if j["band"] is not None and math.isfinite(j["band"]) else None
        row.update(kind="compared", flag=j["flag"], noise=None if band is None else 100 * band,
                   noise_from=j["noise_from"], why=j["why"], paired_speedup=j["paired"], pairs=j["pairs"])
        if j["noise_from"] == "metrics sd":
            notes.append("noise from metrics sd (per-repetition readings not derivable)")
    if row.get("a_cpu") != row.get("b_cpu"):
        notes.append(f"different CPUs: A {row.get('a_cpu')}, B {row.get('b_cpu')}")
    row["note"] = "; ".join(n for n in notes if n) or None
    return row


_PI, _MI = tables.KEYS.index("provenance"), tables.KEYS.index("mode")


def _prov(key: tuple) -> str:
    return key[_PI]


def _conf(key: tuple) -> tuple:
    """The configuration but for what produced its numbers (provenance, and mode: simulate or execute)."""
    return tuple(v for i, v in enumerate(key) if i not in (_PI, _MI))


def _refused(a_keys: list[tuple], b_keys: list[tuple]) -> dict[str, Any]:
    row: dict[str, Any] = dict(zip(tables.KEYS, a_keys[0]))
    for i, name in ((_PI, "provenance"), (_MI, "mode")):
        va, vb = sorted({str(k[i]) for k in a_keys}), sorted({str(k[i]) for k in b_keys})
        row[name] = va[0] if va == vb and len(va) == 1 else f"A {'+'.join(va)} / B {'+'.join(vb)}"
    pa, pb = sorted({_prov(k) for k in a_keys}), sorted({_prov(k) for k in b_keys})
    row.update(flag=REFUSED, kind="refused", note=f"A is {' and '.join(pa)}, B is {' and '.join(pb)}: "
                                                  f"numbers of different provenance are never compared")
    return row


def _order(row: dict[str, Any]) -> tuple:
    keys = ["model", "workload", "environment", "input", "output", "beam", "streams", "system", "variant", "mode"]
    return tuple((row.get(k) is not None, row.get(k) if row.get(k) is not None else 0) for k in keys)


@dataclass
class Comparison:
    rows: pd.DataFrame
    metric: str
    summary: dict[str, Any]
    problem: str | None  # why nothing is comparable (exit 2), else None


def compare(a: Side, b: Side, metric: str = "e2e_tok_s", where: dict[str, str] | None = None,
            tolerance: float = 0.0) -> Comparison:
    """Every configuration of either side, one row each (see the module's docstring)."""
    if metric not in METRICS:
        raise CompareError(f"unknown metric {metric!r}: one of {', '.join(METRICS)}")
    la, lb = _latest(a, where or {}), _latest(b, where or {})
    groups: dict[tuple, list[tuple]] = {}
    for key in dict.fromkeys([*la, *lb]):
        groups.setdefault(_conf(key), []).append(key)
    rows = []
    for keys in groups.values():
        left_a = [k for k in keys if k in la and k not in lb]
        left_b = [k for k in keys if k in lb and k not in la]
        # leftovers whose provenance the other side's leftovers lack: the same configuration, other numbers
        ref_a = [k for k in left_a if _prov(k) not in {_prov(x) for x in left_b}]
        ref_b = [k for k in left_b if _prov(k) not in {_prov(x) for x in left_a}]
        refused = set(ref_a + ref_b) if ref_a and ref_b else set()
        if refused:
            rows.append(_refused(ref_a, ref_b))
        rows += [_pair(key, la.get(key), lb.get(key), metric, tolerance) for key in keys if key not in refused]
    rows.sort(key=_order)
    df = pd.DataFrame(rows)
    summary = _summary(df)
    problem = None
    if not la or not lb:
        empty = [s for s, d in (("A", la), ("B", lb)) if not d]
        problem = (f"{' and '.join(empty)} {'has' if len(empty) == 1 else 'have'} no records"
                   + (" matching --where" if where else ""))
    elif summary["matched"] == 0:
        if summary["refused"]:
            pa, pb = sorted({_prov(k) for k in la}), sorted({_prov(k) for k in lb})
            problem = (f"A is {' and '.join(pa)}, B is {' and '.join(pb)}: refusing to compare "
                       f"(no configuration has the same provenance on both sides; {summary['refused']} refused)")
        else:
            problem = (f"A and B share no configuration ({summary['only_a']} only in A, "
                       f"{summary['only_b']} only in B)")
    return Comparison(df, metric, summary, problem)


def _summary(df: pd.DataFrame) -> dict[str, Any]:
    flags = list(df["flag"]) if len(df) else []
    kinds = list(df["kind"]) if len(df) else []
    speedups = [s for s in (df["speedup"] if "speedup" in df else []) if _num(s) and s > 0]
    return {"compared": len(speedups),
            "geomean_speedup": math.exp(statistics.fmean(map(math.log, speedups))) if speedups else None,
            "faster": flags.count(FASTER), "slower": flags.count(SLOWER),
            "within_noise": sum(f.startswith(NOISE) for f in flags),
            "too_few_reps": sum(f.startswith(NOISE + " (") for f in flags),
            "no_noise_estimate": sum(f in (ONE_REP, NO_SD) for f in flags), "sd_only": flags.count(SD_ONLY),
            "only_a": kinds.count("only_a"), "only_b": kinds.count("only_b"), "refused": kinds.count("refused"),
            "matched": sum(k in ("compared", "not_ok", "no_value") for k in kinds), "not_ok": kinds.count("not_ok")}


# ---------------------------------------------------------------- text


def convention(metric: str) -> str:
    ratio = "A/B (seconds: lower is better)" if metric in LOWER_IS_BETTER else "B/A (tok/s: higher is better)"
    return (f"speedup = {ratio}, so > 1 means B is faster; flag: scripts/ab.py's verdict on the repetitions "
            f"(A's i-th paired with B's i-th), noise ± its band")


def summary_line(s: dict[str, Any]) -> str:
    g = f"{s['geomean_speedup']:.3f}x" if s["geomean_speedup"] is not None else "n/a"
    few = f" ({s['too_few_reps']} with too few reps to tell)" if s["too_few_reps"] else ""
    rest = [(s["no_noise_estimate"], "without a noise estimate"), (s["sd_only"], "mean ± sd only"),
            (s["not_ok"], "not ok"), (s["only_a"], "only in A"), (s["only_b"], "only in B"),
            (s["refused"], "refused (provenance differs)")]
    tail = "; ".join(f"{n} {what}" for n, what in rest if n)
    return (f"{s['compared']} configs compared, geometric mean speedup {g}: {s['faster']} B faster, "
            f"{s['slower']} B slower, {s['within_noise']} within noise{few}" + (f"; {tail}" if tail else ""))


def columns(metric: str, machine: bool = False) -> list[Col]:
    title, digits = METRICS[metric]
    cols = [Col(k, tables.KEY_TITLES.get(k, k), 0 if k in tables.INT_KEYS else None) for k in tables.KEYS]
    cols += [Col("a_status", "A status"), Col("b_status", "B status"), Col("a_reps", "A reps", 0),
             Col("b_reps", "B reps", 0),
             Col("a", f"A {title}", digits, sd="a_sd", lift=False),
             Col("b", f"B {title}", digits, sd="b_sd", lift=False),
             Col("speedup", "speedup", 3, suffix="x", lift=False), Col("noise", "noise ±", 1, suffix="%"),
             Col("noise_from", "noise from"), Col("flag", "flag", lift=False), Col("note", "note"), Col("why", "why")]
    if machine:
        cols += [Col("a_sd", "A sd", digits), Col("b_sd", "B sd", digits), Col("paired_speedup", "paired", 3),
                 Col("pairs", "pairs", 0), Col("a_cpu", "A cpu"), Col("b_cpu", "B cpu"), Col("a_time", "A time"),
                 Col("b_time", "B time")]
    return cols


def to_text(c: Comparison, a: Side, b: Side, fmt: str = "md") -> tuple[str, list[str]]:
    """(the table in `fmt`, the lines around it: the first line naming A, B and the metric, and the summary).
    For md the lines are in the text; machine formats keep the table alone."""
    first = (f"A: {a.label} ({len(a.records)} records) · B: {b.label} ({len(b.records)} records) · "
             f"metric: {c.metric} ({METRICS[c.metric][0]})")
    lines = [first, convention(c.metric), summary_line(c.summary)]
    df = c.rows
    if fmt != "md":
        cols = columns(c.metric, machine=True)
        full = df.reindex(columns=[x.key for x in cols])
        return render(full, cols, fmt=fmt), lines
    return render(df, columns(c.metric), head=lines[:2]) + "\n\n" + lines[2], lines


USAGE = """Compare two record sets configuration by configuration: A's value, B's value, the speedup and whether it
is beyond noise (scripts/ab.py's verdict on the repetitions), like llama.cpp's compare-llama-bench.py.

    python -m runners.compare A B [--metric e2e_tok_s|decode_tok_s|prefill_tok_s|ttft_s]
                              [--where KEY=VALUE ...] [--format md|csv|json|jsonl] [--tolerance PCT] [--repo DIR]
    python -m runners.compare results/measured/run1/records.jsonl results/measured/run2
    python -m runners.compare HEAD~3 results/index.jsonl --where system=fiddler --where workload=beam
    python -m runners.compare 9acbab7:results/measured results/measured --metric decode_tok_s

A and B are each a records/index JSONL file, a directory (every records.jsonl below it), or a git
revision's committed records: REV (every *.jsonl under results/) or REV:PATH (under PATH, relative to the
repository's top; --repo names the repository, default the current directory's). An existing file or
directory always wins over a revision of the same name.

Speedup is B/A for tok/s (higher is better) and A/B for seconds (lower is better): > 1 always means B is
faster. Simulated numbers are never compared with measured or emulated ones (the row says `refused`);
rows measured on different CPUs are compared and say so. Machine formats print the rows alone on stdout
(the lines naming A, B and the summary go to stderr). The rules: runners/compare.py's docstring.

Exit status: 0 it ran; 2 bad usage, a side that names no records, or nothing comparable (said why).
Damaged record lines are reported on stderr with file and line, and skipped.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", metavar="A", help="the base: a JSONL file, a directory, REV or REV:PATH")
    ap.add_argument("b", metavar="B", help="compared with A: the same kinds")
    ap.add_argument("--metric", default="e2e_tok_s", choices=list(METRICS))
    ap.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                    help="only configurations with this key (system, workload, input, ...); repeatable")
    ap.add_argument("--format", default="md", choices=FORMATS)
    ap.add_argument("--tolerance", type=float, default=0.0, metavar="PCT",
                    help="the least change, in percent, that the verdict may call a change (default 0)")
    ap.add_argument("--repo", default=".", help="the git repository revisions are read from (default: here)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    if args.tolerance < 0:
        print(f"compare: --tolerance must be >= 0, got {args.tolerance}", file=sys.stderr)
        return 2
    try:
        where = parse_where(args.where)
        sides = [load(spec, args.repo) for spec in (args.a, args.b)]
        result = compare(*sides, metric=args.metric, where=where, tolerance=args.tolerance / 100)
    except CompareError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that cannot be read
        print(f"compare: {e}", file=sys.stderr)
        return 2
    if result.problem:
        print(f"compare: {result.problem}", file=sys.stderr)
        return 2
    text, lines = to_text(result, *sides, fmt=args.format)
    print(text)
    if args.format != "md":
        print("\n".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":  # python -m runners.compare
    sys.exit(main())
