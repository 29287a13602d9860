"""Rebuild a table from any set of records: JSONL files (records.jsonl, the project index) or
directories holding them (searched recursively).

    python scripts/tables.py results/index.jsonl
    python scripts/tables.py results/multirun/2026-11-29 --out /tmp/table --system fiddler llama_cpp

Damaged lines (any bytes that are not a usable record: not UTF-8, not JSON, the wrong shape, `ok`
without metrics) are reported on stderr with file and line number and skipped, never silently dropped.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runners import tables  # noqa: E402
from runners.records import collect  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="records.jsonl / index files or directories")
    ap.add_argument("--out", help="directory to write table.md and table.csv into")
    ap.add_argument("--system", nargs="*", help="only these systems")
    ap.add_argument("--status", nargs="*", help="only these statuses (default: all)")
    args = ap.parse_args(argv)
    try:
        recs = collect(args.paths)
    except OSError as exc:  # a missing path, or a file that cannot be read
        raise SystemExit(f"error: {exc}") from None
    if args.system:
        recs = [r for r in recs if r.get("system") in args.system]
    if args.status:
        recs = [r for r in recs if r.get("status") in args.status]
    table = tables.build(recs)
    print(tables.to_markdown(table))
    if args.out:
        tables.save(table, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
