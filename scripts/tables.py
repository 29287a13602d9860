"""Rebuild a table from any set of records: JSONL files (records.jsonl, the project index) or
directories holding them (searched recursively).

    python scripts/tables.py results/index.jsonl
    python scripts/tables.py results/multirun/2026-11-29 --out /tmp/table --system fiddler llama_cpp
    python scripts/tables.py results/index.jsonl --workload beam --since 2026-12-01 --format csv
    python scripts/tables.py results/index.jsonl --pivot system --baseline llama_cpp --metric decode_tok_s

Filters (--system, --model, --workload, --environment, --mode, --status: any of the values given;
--since/--until: the record's time, an ISO date or time, compared as times, UTC where no offset is given)
apply before the latest record per configuration is taken. --format md (default) prints the table as Markdown
with constant columns lifted into a header line; csv, json and jsonl print every column's raw values. --pivot
KEY puts KEY's values (usually system) in columns, one metric (--metric, default e2e_tok_s), and --baseline
NAME adds each one's speedup over NAME.

Damaged lines (any bytes that are not a usable record: not UTF-8, not JSON, the wrong shape, `ok`
without metrics) are reported on stderr with file and line number and skipped, never silently dropped.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runners import table_format, tables  # noqa: E402
from runners.records import collect  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="records.jsonl / index files or directories")
    ap.add_argument("--out", help="directory to write table.md and table.csv into")
    for key in tables.FILTERS:
        ap.add_argument(f"--{key}", nargs="+", metavar=key.upper(), help=f"only these {key} values")
    ap.add_argument("--since", help="only records at or after this time (ISO date or time)")
    ap.add_argument("--until", help="only records at or before this time (a date includes that whole day)")
    ap.add_argument("--format", choices=table_format.FORMATS, default="md")
    ap.add_argument("--pivot", choices=tables.KEYS, help="this key's values as columns (e.g. system)")
    ap.add_argument("--metric", default="e2e_tok_s", help="the metric of a pivoted table (default: %(default)s)")
    ap.add_argument("--baseline", help="with --pivot: add each column's speedup over this one")
    args = ap.parse_args(argv)
    if args.baseline and not args.pivot:
        ap.error("--baseline needs --pivot")
    try:
        recs = collect(args.paths)
    except OSError as exc:  # a missing path, or a file that cannot be read
        raise SystemExit(f"error: {exc}") from None
    try:
        recs = tables.select(recs, since=args.since, until=args.until, **{k: getattr(args, k) for k in tables.FILTERS})
    except ValueError as exc:  # a --since/--until that is no time
        ap.error(str(exc))
    table = tables.build(recs)
    if args.pivot:
        if table.empty:
            print("(no records)")
            return 0
        try:
            frame, cols = tables.pivot(table, args.pivot, args.metric, args.baseline)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        what = f"{args.metric} per {args.pivot}" + (f", speedup over {args.baseline}" if args.baseline else "")
        print(table_format.render(frame, cols, fmt=args.format,
                                  head=[tables.header(table), what] if args.format == "md" else ()))
    elif args.format == "md":
        print(tables.to_markdown(table))
    else:
        print(table_format.render(table, [table_format.Col(c, c) for c in table.columns], fmt=args.format))
    if args.out:
        tables.save(table, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
