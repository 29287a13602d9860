#!/usr/bin/env python
"""The A/B's per-round readings from raw_base.jsonl / raw_head.jsonl (every record of every run, written by
sweep.py): each system's status per run, and for e2e tok/s (the key ab.py read) and decode tok/s (the same
runs' decode rate) the per-round head/base and runners.noise.verdict, the rule scripts/ab.py applies.
Kept as data with the commit it ran at.

    python results/measured/2026-12-07-amd-epyc-issue47-ab-10/summarize.py
"""
import json
import statistics
from collections import defaultdict
from pathlib import Path

from runners.noise import verdict

HERE = Path(__file__).resolve().parent
runs = {side: defaultdict(dict) for side in ("base", "head")}  # side -> round -> system -> record
for side in runs:
    for line in (HERE / f"raw_{side}.jsonl").read_text().splitlines():
        r = json.loads(line)
        runs[side][int(r["round"])][r["system"]] = r
rounds = sorted(set(runs["base"]) & set(runs["head"]))
systems = sorted({s for side in runs.values() for rnd in side.values() for s in rnd})
print(f"rounds with both sides: {len(rounds)}")
for s in systems:
    st = {side: sorted({runs[side][n][s]["status"] for n in rounds}) for side in runs}
    print(f"status {s}: base {st['base']} head {st['head']}")
print()
print("| system | metric | per-round head/base | median head/base | noise band | verdict | median base / head |")
print("|---|---|---|---:|---:|---|---:|")
for metric in ("e2e_tok_s", "decode_tok_s"):
    for s in systems:
        b = [runs["base"][n][s].get("metrics", {}).get(metric) for n in rounds]
        h = [runs["head"][n][s].get("metrics", {}).get(metric) for n in rounds]
        if None in b or None in h:
            continue
        v = verdict(b, h)
        ratios = " ".join(f"{y / x:.3f}" for x, y in zip(b, h))
        print(f"| {s} | {metric} | {ratios} | {v['median_ratio']:.3f} | ±{100 * v['band']:.1f}% | {v['verdict']} | "
              f"{statistics.median(b):.2f} / {statistics.median(h):.2f} |")

# Fiddler's speed-up over each baseline (the sweep's table), per side: each round's ratio in that side's run,
# then the median over rounds, and head's over base's
print()
print("| Fiddler / system, e2e tok/s | base (median of rounds) | head | head / base |")
print("|---|---:|---:|---:|")
for s in systems:
    if s == "fiddler":
        continue
    med = {}
    for side in runs:
        r = [runs[side][n]["fiddler"]["metrics"]["e2e_tok_s"] / runs[side][n][s]["metrics"]["e2e_tok_s"]
             for n in rounds if (runs[side][n][s].get("metrics") or {}).get("e2e_tok_s")]
        med[side] = statistics.median(r) if r else None
    if med["base"] and med["head"]:
        print(f"| {s} | {med['base']:.3f} | {med['head']:.3f} | {med['head'] / med['base']:.3f} |")
