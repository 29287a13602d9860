"""Compare two record sets configuration by configuration: A's value, B's value, the speedup and whether it
is beyond noise (scripts/ab.py's verdict on the repetitions), like llama.cpp's compare-llama-bench.py.

    python scripts/compare.py A B [--metric e2e_tok_s|decode_tok_s|prefill_tok_s|ttft_s]
                              [--where KEY=VALUE ...] [--format md|csv|json|jsonl] [--tolerance PCT] [--repo DIR]
    python scripts/compare.py results/measured/run1/records.jsonl results/measured/run2
    python scripts/compare.py HEAD~3 results/index.jsonl --where system=fiddler --where workload=beam
    python scripts/compare.py 9acbab7:results/measured results/measured --metric decode_tok_s

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
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runners import compare  # noqa: E402
from runners.table_format import FORMATS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", metavar="A", help="the base: a JSONL file, a directory, REV or REV:PATH")
    ap.add_argument("b", metavar="B", help="compared with A: the same kinds")
    ap.add_argument("--metric", default="e2e_tok_s", choices=list(compare.METRICS))
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
        where = compare.parse_where(args.where)
        sides = [compare.load(spec, args.repo) for spec in (args.a, args.b)]
        result = compare.compare(*sides, metric=args.metric, where=where, tolerance=args.tolerance / 100)
    except compare.CompareError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that cannot be read
        print(f"compare: {e}", file=sys.stderr)
        return 2
    if result.problem:
        print(f"compare: {result.problem}", file=sys.stderr)
        return 2
    text, lines = compare.to_text(result, *sides, fmt=args.format)
    print(text)
    if args.format != "md":
        print("\n".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
