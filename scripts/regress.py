#!/usr/bin/env python
"""Regression check: runs the benchmark suite (benchmarks/, pytest-benchmark) and compares each
measured *ratio* with its committed floor in results/regression/floors.yaml.

Ratios, never absolute times: each ratio's two sides are measured interleaved in one process and
each side keeps its best time (see benchmarks/conftest.py), so a busy shared machine moves both sides
alike. Floors are kept per kernel path class (cpu_class: "amx" for AVX512-BF16 CPUs with AMX tiles,
"avx512_bf16" without them, "avx2" for the rest: the path the kernel runs there; a forced FIDDLER_KERNEL_ISA
picks its own class) and within a class per CPU (vendor, model name, family and model). A "higher" ratio
passes at or above its floor; a "lower" one (the planner's time in units of a fixed Python workload) at or
below its ceiling. A ratio its benchmark marks "report_only" (one that means nothing on the path that ran:
kernel_vs_limit where the expert is compute-bound) is printed and recorded, never floored (--update drops a floor
it had before).

    python scripts/regress.py --quick          # CI: tiny model + one Mixtral-size expert (a few minutes)
    python scripts/regress.py                  # small_mixtral, more rounds
    python scripts/regress.py --quick --update # record this run's readings; derive the floors from them
    python scripts/regress.py --quick --update -k planner  # only the selected ratios (a new benchmark's first floors)
    python scripts/regress.py --lower kernel_vs_limit_t1=0.7 --reason "why" [--quick]
    python scripts/regress.py --quick --measure kernel_vs_limit_t1 --node 'benchmarks/test_kernel_ratios.py::test_kernel[1]' \
        [--root TREE]                          # one JSON line of the ratios read, judged by nothing (scripts/ab.py)

--update keeps the last HISTORY readings of every ratio, per CPU, in the file and derives each floor from
them: on every CPU with readings, the window's low quantile (low_reading: the worst of 3-4 readings, the
second worst of 5-8) less the margin (the file's, or the ratio's own); the class floor is the lowest of
those over the CPUs, and this CPU needs UPDATE_WINDOW readings before it moves anything. The floor follows
the window both ways (no ratchet): a few readings taken on a quiet machine, or beside a reference side that
ran unusually slow, once set floors that no normal run reached (min of the last 3 less the margin, only
rising: engine_decode_vs_transformers on a Zen 4 at 30.8 against CI readings of 6.5), while one reading
of a busy moment among five or more moves nothing. A floor that gets looser is printed as such by --update,
and the file's diff shows it. Each CPU (model name, family and model) also gets its own floor by the same rule
from its own readings ('cpu_floors'), and is judged by it once it has one; a CPU without one is judged by
the class floor (so a new CPU, or a regression on one, still meets the class's floor or the side-by-side
below). A ratio judged by the class floor (this CPU has no floor of its own) that crosses it is not
measured again ratio by ratio: a re-reading would only confirm that this CPU is another one than those the
class floor came from; it goes straight to the one side-by-side run below. Lowering a floor below what its readings support needs --lower with a --reason, which is stored
next to the floor and caps the floors --update derives from then on (the class floor at the lowering's
'to', every CPU's own at its 'cpu_floors_at_most': lowering_caps) until the entry is removed from the file:
readings taken beside busy neighbours can sit above every quiet run (engine_decode_vs_transformers on a
2-vCPU Zen 4 read 15-142 under other sessions' load, 6.5 in CI), and no rule over them finds that level. --update with -k records only the ratios read and never moves the reference build (a
partial run cannot vouch for the floors it did not read).
A ratio measured on another kernel path than its recorded readings on this CPU ran (a fallback, which
a floor sized for noise may not tell apart) fails at once, whatever its value.
A ratio that crosses its floor is measured again (its benchmark alone, with twice the rounds), up to
len(CONFIRM_PAUSES_S) times, after the pauses listed there, and fails only if every reading crosses: all
readings are printed, with the share of vCPU time the host took (steal) and the load during each. A
regression crosses every time; a reading taken while other tenants of a shared VM were busy does not
(CI once read q4_0 at 0.62 of the limit, then 0.81 minutes later; such a busy phase can outlast one
re-measurement taken right away, as kernel_vs_limit_t4 at 0.616 and 0.630 against 0.72-0.80 on the
same binary, A/B-checked against an older build, showed).
A ratio that crosses at every reading is measured last side by side with the reference build (floors.yaml's
'reference': a commit that met every floor; --update sets it to the commit it read), exported and built
in a temporary folder, AB_ROUNDS rounds of one reading of each build, the order alternated (ABBA), judged
by scripts/ab.py's noise rule on the readings paired by round: it fails if this build reads worse beyond
noise and by more than AB_TOLERANCE, or when there is no reference to compare. A busy machine slows both
builds alike, and one quiet moment lifts one round; a regression slows this build in nearly every round.
--measure runs the benchmarks (of the tree at --root, which may be another revision's export: its
benchmarks/ and its code; only the --node test ids where given) and prints one JSON line of the ratios read,
by name, for scripts/ab.py --key NAME; it judges nothing and exits 2 when a named ratio was not read.
Exit status: 0 all pass, 1 a ratio crossed its floor (each is named), 2 the suite itself failed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ab.py, beside this file
from ab import export_build, min_rounds  # noqa: E402
from ab import verdict as ab_verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ROOT / "results" / "regression" / "floors.yaml"
UPDATE_WINDOW = 3  # readings a CPU needs before a floor is derived from them
HISTORY = 8  # readings kept per ratio and CPU: the window a floor is derived from
FLOOR_QUANTILE = 0.25  # a floor sits the margin below this low quantile of the window (low_reading)
CONFIRM_PAUSES_S = (0, 45, 90)  # a crossing ratio is re-measured after each pause until one reading clears
AB_ROUNDS = min_rounds()  # rounds of the side-by-side check: the fewest with which ab.verdict can tell
AB_TOLERANCE = 0.10  # this build may read this much worse than the reference build, side by side


def cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_class(flags: set[str], forced: str | None = None) -> str:
    """The floors' class: the kernel path this CPU runs (fk_cpu.cpp's choice), since a ratio's level is the
    path's: "amx" (AVX512-BF16 and AMX-BF16 tiles: Intel Sapphire Rapids and later), "avx512_bf16" (vdpbf16ps
    without AMX: AMD Zen 4 and 5, Intel Cooper Lake), "avx512" (AVX-512 F/BW/VL/DQ without BF16: Skylake-SP to
    Ice Lake Xeons, VMs that hide BF16), else "avx2". A forced FIDDLER_KERNEL_ISA (`forced`:
    fiddler.kernels.set_isa's names) is its own class."""
    if forced and forced != "auto":
        return forced
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx2"
    if "avx512_bf16" not in flags:
        return "avx512"
    return "amx" if {"amx_tile", "amx_bf16"} <= flags else "avx512_bf16"


def cpu_name() -> str:
    """The CPU a reading is of: its model name with its family and model, since a VM's name alone does
    not tell CPUs apart ("AMD EPYC" is a Zen 3, 4 or 5; Zen 4 and 5 share the avx512 class)."""
    fields = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
    except OSError:
        pass
    name = fields.get("model name", "unknown")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def reading_cpu() -> str:
    """What readings and a CPU's own floors are recorded under: cpu_name(), and a forced kernel path,
    which is a proxy for another CPU class, named."""
    isa = os.environ.get("FIDDLER_KERNEL_ISA")
    return f"{cpu_name()} (FIDDLER_KERNEL_ISA={isa})" if isa else cpu_name()


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat: the host's share of our vCPUs' time."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[7] if len(v) > 7 else 0, sum(v[:8])
    except (OSError, ValueError, IndexError):
        return None


def machine_state(since: tuple[int, int] | None) -> str:
    """One line on what else ran on the machine since `since` (cpu_times()): steal and the 1-min load."""
    now, parts = cpu_times(), []
    if since and now and now[1] > since[1]:
        parts.append(f"steal {100 * (now[0] - since[0]) / (now[1] - since[1]):.1f}% of vCPU time")
    try:
        parts.append(f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    except OSError:
        pass
    return ", ".join(parts) or "machine state unknown"


def load_per_cpu() -> float | None:
    """The 1-min load average over the CPU count, recorded with each reading: a note of how busy the machine
    was (a ratio whose sides a busy neighbour slows unequally reads another level then), not used by the rule."""
    try:
        return round(os.getloadavg()[0] / (os.cpu_count() or 1), 2)
    except OSError:
        return None


def run_suite(quick: bool, select: str | None, nodes: list[str] | None = None,
              rounds: int | None = None, root: Path = ROOT) -> tuple[list[dict], list[dict], int]:
    """Runs benchmarks/ of the tree at `root` (or only the given test node ids, relative to it; `rounds`
    overrides the suite's rounds) and returns (ratios, skipped ratios, pytest's exit code)."""
    with tempfile.TemporaryDirectory() as tmp:
        report, skips = Path(tmp) / "bench.json", Path(tmp) / "skips.jsonl"
        cmd = [sys.executable, "-m", "pytest", *(nodes or [str(root / "benchmarks")]), "-q", "--no-header", "-p", "no:cacheprovider",
               "--benchmark-enable", "--benchmark-quiet", f"--benchmark-json={report}", "-o", "console_output_style=classic"]
        if quick:
            cmd.append("--quick")
        if select:
            cmd += ["-k", select]
        env = {**os.environ, "FIDDLER_REGRESS_SKIPS": str(skips)}
        if rounds:
            env["FIDDLER_REGRESS_ROUNDS"] = str(rounds)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine's setting; see benchmarks/test_system_ratios.py
        rc = subprocess.run(cmd, cwd=root, env=env).returncode
        ratios = []
        if report.exists():
            for b in json.loads(report.read_text())["benchmarks"]:
                for r in b.get("extra_info", {}).get("ratios", []):
                    ratios.append({**r, "test": b["fullname"]})
        skipped = [json.loads(l) for l in skips.read_text().splitlines()] if skips.exists() else []
        return ratios, skipped, rc


def load_floors() -> dict:
    if not FLOORS.exists():
        return {"margin": 0.15, "classes": {}}  # margin: a floor sits this fraction below its readings
    return yaml.safe_load(FLOORS.read_text()) or {}


def save_floors(data: dict) -> None:
    header = ("# Floors of scripts/regress.py (see its docstring): per CPU class, per ratio. 'readings' are the\n"
              f"# last {HISTORY} measurements per CPU recorded with --update (with the 1-min load per CPU then, where\n"
              "# recorded); 'floor' is derived from them at each --update (each CPU's low quantile of its readings\n"
              "# less the margin, the lowest over the CPUs); 'cpu_floors' are each CPU's own, by the same rule from\n"
              "# its readings alone; 'lowered' keeps every explicit lowering and its reason, and caps the derived\n"
              "# floors until it is removed.\n")
    FLOORS.parent.mkdir(parents=True, exist_ok=True)
    tmp = FLOORS.with_suffix(".tmp")
    tmp.write_text(header + yaml.safe_dump(data, sort_keys=False, width=110))
    tmp.replace(FLOORS)


def check(ratios: list[dict], floors: dict) -> list[dict]:
    """Each ratio against its floor, and its kernel path against the paths its recorded readings on this
    CPU ran: a ratio measured on another path (a fallback the floor may not tell apart) fails as "path"."""
    rows, me = [], reading_cpu()
    for r in ratios:
        e = floors.get(r["name"], {})
        own = (e.get("cpu_floors") or {}).get(me)
        f = own if own is not None else e.get("floor")
        known = {x["path"] for x in e.get("readings", []) if x.get("cpu") == me and x.get("path")}
        if r.get("report_only"):
            f, own, status = None, None, "report"
        elif f is None:
            status = "no floor"
        elif r.get("path") and known and r["path"] not in known:
            status = "FAIL"
            r = {**r, "what": f"{r['what']} -- ran path {r['path']}, the readings on this CPU ran "
                              f"{', '.join(sorted(known))}", "path_changed": True}
        elif r["direction"] == "higher":
            status = "pass" if r["value"] >= f else "FAIL"
        else:
            status = "pass" if r["value"] <= f else "FAIL"
        rows.append({**r, "floor": f, "floor_of": "cpu" if own is not None else "class", "status": status})
    return rows


def recheck_rounds(quick: bool) -> int:
    """Rounds of a re-measurement: twice the suite's (benchmarks/conftest.py), a longer window to find a
    quiet moment in."""
    return 2 * int(os.environ.get("FIDDLER_REGRESS_ROUNDS", 5 if quick else 9))


def confirm(rows: list[dict], table: dict, quick: bool) -> list[dict] | None:
    """Measures the benchmarks of the failed ratios again, after each pause of CONFIRM_PAUSES_S, with
    twice the suite's rounds, until every one has a reading that clears its floor; a ratio fails only if
    all its readings cross (each reading is already the best of its rounds). None when a re-run failed."""
    failed = [r for r in rows if r["status"] == "FAIL" and not r.get("path_changed") and r["floor_of"] == "cpu"]
    for r in rows:  # below the class floor, none of this CPU's own: no re-reading, straight to the side-by-side run
        if r["status"] == "FAIL" and not r.get("path_changed") and r["floor_of"] == "class":
            r["readings"] = [r["value"]]
    if not failed:
        return rows
    readings = {r["name"]: [r["value"]] for r in failed}
    rounds = recheck_rounds(quick)
    print(f"\nregress: {len(failed)} ratio(s) crossed the floor; measuring them again (up to "
          f"{len(CONFIRM_PAUSES_S)} times, {rounds} rounds) to tell a regression from a busy machine")
    out = {r["name"]: r for r in rows}
    for k, pause in enumerate(CONFIRM_PAUSES_S, 1):
        crossing = [r for r in out.values() if r["name"] in readings and r["status"] == "FAIL"]
        nodes = sorted({r["test"] for r in crossing if r.get("test")})
        if not nodes:
            break
        if pause:
            print(f"regress: waiting {pause} s before reading {k + 1}")
            time.sleep(pause)
        since = cpu_times()
        again, _, rc = run_suite(quick, None, nodes, rounds=rounds)
        if rc not in (0, 5):
            print(f"regress: the confirmation run failed (pytest exit {rc})", file=sys.stderr)
            return None
        print(f"regress: reading {k + 1} of {', '.join(nodes)}: {machine_state(since)}")
        second = {r["name"]: r for r in again}
        for r in crossing:
            if r["name"] in second:
                readings[r["name"]].append(second[r["name"]]["value"])
            vals = readings[r["name"]]
            best = max(vals) if r["direction"] == "higher" else min(vals)
            out[r["name"]] = {**check([{**r, "value": best}], table)[0], "readings": vals}
    print("\nconfirmation (a ratio fails only if every reading crosses its floor):")
    for r in out.values():
        if "readings" in r:
            print(f"  {r['name']:<46} floor {r['floor']:.4g}  readings {', '.join(f'{v:.4g}' for v in r['readings'])}"
                  f"  -> {r['status']}")
    return list(out.values())


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def reference_build(commit: str, dest: Path) -> str | None:
    """Exports `commit` of this repository into dest and builds its kernel there (the same environment);
    None when it is ready, else why not (scripts/ab.py's export_build)."""
    return export_build(commit, dest, ROOT)


def nodes_in(root: Path, nodes: list[str]) -> list[str]:
    """The benchmark test node ids (file::function[params]) whose file defines that function in the tree at
    root: a reference build older than a benchmark lacks its node, and pytest given one missing node runs none
    (exit 4)."""
    have = []
    for node in nodes:
        parts = node.split("::")
        f, name = root / parts[0], parts[-1].split("[", 1)[0] if len(parts) > 1 else ""
        if name and f.is_file() and re.search(rf"^\s*def {re.escape(name)}\(", f.read_text(), re.M):
            have.append(node)
    return have


def side_by_side(rows: list[dict], reference: dict | None, quick: bool) -> list[dict]:
    """The last word on a ratio whose every reading crossed its floor: its benchmark on the reference
    build (a commit that met every floor, floors.yaml's 'reference') and on this one, AB_ROUNDS rounds
    of one reading each, the order alternated (ABBA: neither build always first), judged with
    scripts/ab.py's noise rule on the readings paired by round. A busy machine lowers both builds alike
    and one quiet moment lifts one round only; a regression lowers this build in nearly every round. The
    ratio fails when the rule says "changed" towards worse by more than AB_TOLERANCE, and stays failed
    when there is no reference or it cannot be built."""
    crossing = [r for r in rows if r["status"] == "FAIL" and "readings" in r]
    names = {r["name"] for r in crossing}
    commit = (reference or {}).get("commit")
    if not crossing or not commit:
        return rows
    nodes = sorted({r["test"] for r in crossing if r.get("test")})
    rounds = recheck_rounds(quick)
    print(f"\nregress: {len(crossing)} ratio(s) crossed at every reading; measuring them side by side with the "
          f"reference build {commit[:12]} ({AB_ROUNDS} rounds, ABBA) to tell a regression from a busy machine")
    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="regress-reference-") as tmp:
        why = reference_build(commit, Path(tmp))
        if why:
            print(f"regress: no side-by-side check: {why}", file=sys.stderr)
            return rows
        lacking = [n for n in nodes if n not in nodes_in(Path(tmp), nodes)]
        if lacking:  # those ratios stay failed: there is nothing to compare them with
            print(f"regress: the reference build {commit[:12]} has no {', '.join(lacking)}; its ratios stay failed "
                  "(floors.yaml's 'reference' must be a build that has every benchmark)", file=sys.stderr)
            nodes = [n for n in nodes if n not in lacking]
            if not nodes:
                return rows
        sides = ((Path(tmp), theirs), (ROOT, ours))
        for k in range(AB_ROUNDS):
            got_round: dict[int, dict[str, float]] = {}
            for i in ((0, 1) if k % 2 == 0 else (1, 0)):
                got, _, rc = run_suite(quick, None, nodes, rounds=rounds, root=sides[i][0])
                if rc not in (0, 5):
                    print(f"regress: the side-by-side run in {sides[i][0]} failed (pytest exit {rc})", file=sys.stderr)
                    return rows
                got_round[i] = {g["name"]: g["value"] for g in got}
            for name in set(got_round[0]) & set(got_round[1]):  # a round counts only with both readings
                theirs.setdefault(name, []).append(got_round[0][name])
                ours.setdefault(name, []).append(got_round[1][name])
    out = []
    print(f"\nside by side with {commit[:12]} (a ratio fails if this build reads worse than the reference beyond "
          f"noise and by more than {AB_TOLERANCE:.0%}; scripts/ab.py's rule on readings paired by round):")
    for r in rows:
        if r["name"] in names and ours.get(r["name"]):
            v = ab_verdict(theirs[r["name"]], ours[r["name"]], tolerance=AB_TOLERANCE)
            worse = v["changed"] and v["direction"] == ("lower" if r["direction"] == "higher" else "higher")
            r = {**r, "status": "FAIL" if worse else "pass",
                 "side_by_side": {"reference": commit, "this": ours[r["name"]], "ref": theirs[r["name"]],
                                  "rel": v["median_ratio"], "verdict": v["verdict"], "why": v["why"]}}
            print(f"  {r['name']:<46} this {', '.join(f'{x:.4g}' for x in ours[r['name']])}; reference "
                  f"{', '.join(f'{x:.4g}' for x in theirs[r['name']])}  this/reference {v['median_ratio']:.3f} "
                  f"(median of rounds): {v['verdict']}, {v['why']}  -> "
                  + ("FAIL" if worse else "pass: the machine read low, not this build"))
        out.append(r)
    return out


def print_table(rows: list[dict], skipped: list[dict], cls: str) -> None:
    print(f"\nregression ratios on {reading_cpu()} (floors: {cls}, * this CPU's own; each ratio's sides interleaved, "
          "best of the rounds)")
    head = f"{'ratio':<46} {'floor':>9} {'measured':>9} {'':>2} {'status':<8} what"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        f = "-" if r["floor"] is None else f"{r['floor']:.4g}" + ("*" if r.get("floor_of") == "cpu" else "")
        sign = ">=" if r["direction"] == "higher" else "<="
        extra = f" [{r['path']}]" if r.get("path") else ""
        if r.get("report_only"):
            extra += f" (reported, not floored: {r['report_only']})"
        print(f"{r['name']:<46} {f:>9} {r['value']:>9.4g} {sign:>2} {r['status']:<8} {r['what']}{extra}")
    for s in skipped:
        for name in s["ratios"]:
            print(f"{name:<46} {'':>9} {'':>9} {'':>2} {'skipped':<8} {s['reason']}")


def floors_of(data: dict, cls: str, mode: str, create: bool = False) -> dict:
    """The floors of one CPU class and suite mode ("quick" or "full")."""
    if create:
        return data.setdefault("classes", {}).setdefault(cls, {}).setdefault(mode, {})
    return (data.get("classes", {}).get(cls) or {}).get(mode) or {}


def low_reading(values: list[float], higher: bool) -> float:
    """The window's low quantile (FLOOR_QUANTILE), a reading itself: the one at rank floor(q (n - 1)) from the
    worst end, so the worst of 3-4 readings and the second worst of 5-8. One reading of a busy moment among
    five does not set the floor; a few readings far above the rest (a quiet machine, or a reference side that
    ran unusually slow) do not lift it above what the normal runs read."""
    ranked = sorted(values, reverse=not higher)
    return ranked[int(FLOOR_QUANTILE * (len(ranked) - 1))]


def lowering_caps(e: dict, higher: bool) -> tuple[float | None, float | None]:
    """(class cap, every CPU's own cap) of a ratio's --lower entries: a lowering says the readings overstate
    the level a normal run reaches (they were taken beside busy neighbours, or on another build), so the
    floors derived from them stay at or below it until the entry is removed from the file."""
    pick = min if higher else max
    tos = [x["to"] for x in e.get("lowered") or [] if x.get("to") is not None]
    cpus = [x.get("cpu_floors_at_most", x.get("to")) for x in e.get("lowered") or []]
    cpus = [c for c in cpus if c is not None]
    return (pick(tos) if tos else None), (pick(cpus) if cpus else None)


def update(data: dict, table: dict, ratios: list[dict], load: float | None = None) -> list[str]:
    """Appends this run's readings (with the load per CPU they were taken at), keeps each CPU's last HISTORY, and derives every floor they support: on
    each CPU that has readings, low_reading of its window less the margin; the floor is the lowest of those
    over the CPUs (a class holds different CPUs, e.g. Intel with AMX and AMD Zen 5, and must pass on all of
    them), and this CPU needs UPDATE_WINDOW readings before it moves anything. This CPU's own floor
    ('cpu_floors') comes by the same rule from its readings alone. A floor follows its window both ways:
    a derived floor looser than the old one is recorded and printed as such."""
    today = _dt.date.today().isoformat()
    me = reading_cpu()
    changes = []
    for r in ratios:
        e = table.setdefault(r["name"], {"direction": r["direction"], "floor": None, "readings": []})
        e["what"] = r["what"]
        if r.get("margin") is not None and "margin" not in e:
            e["margin"] = r["margin"]  # the benchmark's own margin (noisier ratios), kept once set
        readings = (e.get("readings") or []) + [
            {"value": round(r["value"], 5), "date": today, "cpu": me, "path": r.get("path"), "load": load}]
        count: dict[str, int] = {}
        for x in readings:
            count[x["cpu"]] = count.get(x["cpu"], 0) + 1
        keep = {c: n - HISTORY for c, n in count.items()}  # keep the last HISTORY readings of every CPU
        kept = []
        for x in readings:
            if keep[x["cpu"]] > 0:
                keep[x["cpu"]] -= 1
            else:
                kept.append(x)
        e["readings"] = kept
        by_cpu: dict[str, list[float]] = {}
        for x in kept:
            by_cpu.setdefault(x["cpu"], []).append(x["value"])
        if r.get("report_only"):  # its path makes it meaningless (a class is a path): a floor it had goes
            if e.get("floor") is not None or e.get("cpu_floors"):
                changes.append(f"{r['name']}: floor {e.get('floor')} -> None (reported, not floored: {r['report_only']})")
            e["floor"] = None
            e.pop("cpu_floors", None)
            continue
        if len(by_cpu[me]) < UPDATE_WINDOW:
            continue
        margin = float(e.get("margin", data.get("margin", 0.15)))
        higher = r["direction"] == "higher"
        low = {c: low_reading(v, higher) for c, v in by_cpu.items()}
        bound = (lambda w: round(w * (1 - margin), 4)) if higher else (lambda w: round(w * (1 + margin), 6))

        def moved(what: str, old, new) -> None:
            if new != old:
                looser = old is not None and (new < old if higher else new > old)
                changes.append(f"{what}: {old} -> {new}" + (" (looser: the window's readings support no more)"
                                                            if looser else ""))

        capped = (lambda v, cap: v if cap is None else (min(v, cap) if higher else max(v, cap)))
        class_cap, cpu_cap = lowering_caps(e, higher)
        cand = capped(bound(min(low.values()) if higher else max(low.values())), class_cap)
        moved(r["name"], e["floor"], cand)
        e["floor"] = cand
        # this CPU's own floor, by the same rule from its readings alone: judged by it, a CPU slower
        # than the class's others at a ratio (Zen 5's bf16 compute against Intel's) is not measured
        # again and side by side at every run, and a faster one is held to its own level
        own = e.setdefault("cpu_floors", {})
        mine = capped(bound(low[me]), cpu_cap)
        moved(f"{r['name']} on {me}", own.get(me), mine)
        own[me] = mine
    return changes


def set_reference(data: dict, crossed: list[str]) -> str:
    """After --update: the build these readings came from becomes the side-by-side reference when it is a
    commit (a clean tree but for the floors file) and met every floor it had (`crossed` names those it
    did not: a build below its floors must never become the yardstick); else the reference stays."""
    if crossed:
        return f"reference build unchanged (this build crossed the floor of {', '.join(crossed)})"
    try:
        own = str(FLOORS.relative_to(ROOT)) if FLOORS.is_relative_to(ROOT) else FLOORS.name
        dirty = [l for l in git("status", "--porcelain").splitlines() if not l.endswith(own)]
        head = git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "reference build unchanged (no git here)"
    if dirty:
        return f"reference build unchanged ({len(dirty)} uncommitted change(s): these readings are not of a commit)"
    data["reference"] = {"commit": head, "date": _dt.date.today().isoformat(), "cpu": cpu_name(),
                         "why": "the build of the last --update's readings"}
    return f"reference build: {head[:12]}"


def lower(table: dict, spec: str, reason: str) -> str:
    name, _, value = spec.partition("=")
    if name not in table:
        raise SystemExit(f"regress: no floor named {name!r} here; known: {', '.join(sorted(table))}")
    try:
        new = float(value)
    except ValueError:
        raise SystemExit(f"regress: --lower needs NAME=NUMBER, got {spec!r}") from None
    e = table[name]
    old = e.get("floor")
    higher = e.get("direction", "higher") == "higher"
    # never raised by a lowering: a value above the class floor lowers only the CPU floors above it
    e["floor"] = new if old is None else (min(old, new) if higher else max(old, new))
    for cpu, f in (e.get("cpu_floors") or {}).items():  # after a lowering no floor of it is above `new`
        e["cpu_floors"][cpu] = min(f, new) if higher else max(f, new)
    e.setdefault("lowered", []).append({"from": old, "to": e["floor"], "cpu_floors_at_most": new,
                                        "date": _dt.date.today().isoformat(),
                                        "cpu": reading_cpu(), "reason": reason})
    return f"{name}: {old} -> {e['floor']}, every CPU's own at most {new} ({reason})"


def measure(names: str, quick: bool, select: str | None, nodes: list[str] | None, root: Path) -> int:
    """--measure: runs the benchmarks of the tree at `root` (only `nodes` where given) and prints one JSON
    line of every ratio read, by name, plus the kernel path of each ("paths") and the root; 2 when the
    suite failed or a ratio in `names` (comma-separated) was not read."""
    root = root.resolve()
    if not (root / "benchmarks").is_dir():
        print(f"regress: --root {root} has no benchmarks/", file=sys.stderr)
        return 2
    since = cpu_times()
    ratios, skipped, rc = run_suite(quick, select, nodes, root=root)
    state = machine_state(since)
    if rc not in (0, 5):
        print(f"regress: the benchmark suite in {root} failed (pytest exit {rc})", file=sys.stderr)
        return 2
    got = {r["name"]: r["value"] for r in ratios}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    missing = [n for n in wanted if n not in got]
    if missing:
        why = {n: s["reason"] for s in skipped for n in s["ratios"]}
        print("regress: not measured: " + "; ".join(f"{n}" + (f" (skipped: {why[n]})" if n in why else "")
                                                     for n in missing)
              + (f"; read: {', '.join(sorted(got))}" if got else ""), file=sys.stderr)
        return 2
    for n in wanted:
        print(f"regress: {n} = {got[n]:.4g} in {root} ({state})", file=sys.stderr)
    print(json.dumps({**got, "paths": {r["name"]: r.get("path") for r in ratios}, "root": str(root)}))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI subset (tiny model, one Mixtral-size expert)")
    ap.add_argument("--update", action="store_true", help="record the readings and derive the floors from them")
    ap.add_argument("--lower", metavar="NAME=VALUE", help="lower one floor (needs --reason); runs nothing")
    ap.add_argument("--reason", help="why a floor is lowered (stored in the file)")
    ap.add_argument("-k", dest="select", help="only the benchmarks pytest -k selects (with --update: records only "
                                              "their ratios and leaves the reference build as it is)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--measure", metavar="NAME[,NAME...]",
                    help="measure only, judge nothing: print one JSON line {ratio: value, ...} of every ratio read "
                         "(exit 2 when a NAME is not among them); a command for scripts/ab.py --key NAME")
    ap.add_argument("--node", action="append", metavar="NODE",
                    help="with --measure: run only this benchmark test node, relative to --root "
                         "(repeatable; e.g. 'benchmarks/test_kernel_ratios.py::test_kernel[1]')")
    ap.add_argument("--root", type=Path, help="with --measure: the tree whose benchmarks/ run (default: this one)")
    ap.add_argument("--class", dest="cls", help=argparse.SUPPRESS)  # tests only
    args = ap.parse_args(argv)
    if (args.node or args.root) and not args.measure:
        ap.error("--node and --root go with --measure")
    if args.measure:
        if args.update or args.lower:
            ap.error("--measure judges and records nothing; do not combine it with --update or --lower")
        return measure(args.measure, args.quick, args.select, args.node, args.root or ROOT)
    cls = args.cls or cpu_class(cpu_flags(), os.environ.get("FIDDLER_KERNEL_ISA"))
    mode = "quick" if args.quick else "full"
    data = load_floors()
    if args.lower:
        if not args.reason or not args.reason.strip():
            ap.error("--lower needs --reason: the reason is stored with the floor")
        print(lower(floors_of(data, cls, mode), args.lower, args.reason.strip()))
        save_floors(data)
        return 0
    since = cpu_times()
    ratios, skipped, rc = run_suite(args.quick, args.select)
    state, load = machine_state(since), load_per_cpu()
    if rc not in (0, 5) or not ratios:  # 5: no tests collected (-k matched nothing)
        print(f"regress: the benchmark suite failed (pytest exit {rc}); no ratio is judged", file=sys.stderr)
        return 2
    table = floors_of(data, cls, mode)
    if not any(e.get("floor") is not None for e in table.values()):
        print(f"regress: the class {cls} ({mode}) has no floors yet: nothing is judged; record them with "
              f"three runs of --update", file=sys.stderr)
    rows = check(ratios, table)
    print_table(rows, skipped, f"{cls}, {mode}")
    print(f"during the suite: {state}")
    if args.json:
        Path(args.json).write_text(json.dumps({"class": cls, "cpu": cpu_name(), "rows": rows, "skipped": skipped},
                                              indent=1))
    if args.update:
        for c in update(data, floors_of(data, cls, mode, create=True), ratios, load) or ["no floor changed"]:
            print("update:", c)
        print("update:", "reference build unchanged (-k: a partial run)" if args.select
              else set_reference(data, [r["name"] for r in rows if r["status"] == "FAIL"]))
        save_floors(data)
        return 0
    if not args.update and any(r["status"] == "FAIL" and not r.get("path_changed") for r in rows):
        rows = confirm(rows, table, args.quick)
        if rows is None:
            return 2
        rows = side_by_side(rows, data.get("reference"), args.quick)
    failed = [r for r in rows if r["status"] == "FAIL"]
    missing = sorted({n for n, e in table.items() if e.get("floor") is not None} - {r["name"] for r in rows}
                     - {n for s in skipped for n in s["ratios"]})
    if missing and not args.select:
        print(f"\nregress: {len(missing)} floor(s) had no reading: {', '.join(missing)}", file=sys.stderr)
        return 2
    if failed:
        print("\nregress: FAILED " + "; ".join(
            f"{r['name']} ran path {r['path']}, not a path of its readings on this CPU" if r.get("path_changed")
            else f"{r['name']} = {r['value']:.4g} {'<' if r['direction'] == 'higher' else '>'} floor {r['floor']:.4g}"
            for r in failed), file=sys.stderr)
        return 1
    ab = [r["name"] for r in rows if "side_by_side" in r]
    print(f"\nregress: all {len(rows)} ratio{'s' if len(rows) != 1 else ''} pass ({sum(r['floor'] is None for r in rows)} without a floor"
          + (f"; {', '.join(ab)} only side by side with the reference build, below its floor" if ab else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
