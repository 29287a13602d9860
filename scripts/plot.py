"""Plot any sweep from records, in the style of the paper figures (runners/figures.py).

    python scripts/plot.py results/index.jsonl --x input_len --y decode_tok_s
    python scripts/plot.py results/runs/2026-12-02 --x beam_width --y e2e_tok_s --by system --where workload=beam
    python scripts/plot.py results/index.jsonl --x concurrency --y output_tok_s --out /tmp/serving --format png

INDEX_OR_RUN_DIR: a records/index JSONL file or a directory holding records.jsonl files. --x and --y are
keys or metrics of the run table (input_len/input, output_len/output, beam_width/beam, concurrency/streams;
e2e_tok_s, decode_tok_s, prefill_tok_s, ttft_s, serving metrics). One line per --by value (default system);
keys that vary besides them make one panel each. --where key=value (repeatable) keeps matching rows.
Simulated and measured numbers are never on one line. Writes OUT.png/.pdf/.svg (default: plot_<y>_by_<x>
beside the first input) and prints the paths.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runners import figures, tables  # noqa: E402
from runners.records import collect  # noqa: E402


def where(df, conditions: list[str]):
    for cond in conditions:
        key, sep, value = cond.partition("=")
        key = figures.KEY_ALIASES.get(key, key)
        if not sep or key not in df.columns:
            raise ValueError(f"--where {cond!r}: expected KEY=VALUE with KEY one of {', '.join(map(str, df.columns))}")
        df = df[[str(v) == value or (_num(v) is not None and _num(v) == _num(value)) for v in df[key]]]
    return df


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", metavar="INDEX_OR_RUN_DIR")
    ap.add_argument("--x", required=True)
    ap.add_argument("--y", required=True)
    ap.add_argument("--by", nargs="+", default=["system"])
    ap.add_argument("--where", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", help="output path without extension")
    ap.add_argument("--format", nargs="+", choices=figures.FORMATS, default=list(figures.FORMATS))
    ap.add_argument("--title")
    args = ap.parse_args(argv)
    try:
        recs = collect(args.paths)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    df = tables.build(recs)
    if df.empty:
        print("error: no records in " + ", ".join(args.paths), file=sys.stderr)
        return 2
    first = Path(args.paths[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent) / f"plot_{args.y}_by_{args.x}"
    try:
        paths = figures.sweep(where(df, args.where), args.x, args.y, args.by, out, args.title, args.format)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
