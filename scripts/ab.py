#!/usr/bin/env python
"""A/B: one command measured on a base revision and on the working tree, interleaved, and judged by one
noise rule (`verdict`).

    python scripts/ab.py --base REV [--rounds N] [--key NAME] [--tolerance PCT] [--json] -- COMMAND...

REV is exported from git (git archive) into a temporary folder and, where it has a setup.py, its C++
kernel is built there (`python setup.py build_ext --inplace`, with this Python; `export_build`, which
scripts/regress.py's reference build uses too). The head is the working tree of the repository this script
lives in (or --repo), uncommitted changes included; its kernel is brought up to date the same way
(incremental: a no-op when nothing changed). --no-build skips both builds.

The command runs once per side per round, N rounds (default 5), in ABBA order (round 1 base then head,
round 2 head then base, ...) so that a drift of the machine (a neighbour starting, a cache warming) falls
on both sides alike. It runs with cwd = that side's tree, PYTHONPATH = that tree first (so
`python -c 'import fiddler'` imports that side's code), this Python's folder first on PATH, and
AB_SIDE=base|head, AB_TREE=<the tree>, AB_ROUND=<1..N>, AB_PYTHON=<this Python>, AB_BASE_TREE and
AB_HEAD_TREE (both trees, e.g. to run the head's script on either tree) exported. One argument after `--`
runs through `sh -c` (quote it to use "$AB_TREE"); several run as they are. For example, the head's
regress.py measuring one ratio on each tree (an older regress.py may lack --measure):

    python scripts/ab.py --base 69f45c6 --key kernel_vs_limit_t1 -- 'python "$AB_HEAD_TREE/scripts/regress.py" \
        --quick --measure kernel_vs_limit_t1 --node "benchmarks/test_kernel_ratios.py::test_kernel[1]" --root "$AB_TREE"'

Its reading is the last stdout line that is a number, or with --key NAME the last line that is a JSON
object holding NAME (a dotted NAME such as a.b reads {"a": {"b": ...}} where there is no key "a.b").
--key may be given several times: every run is read for each, and each key gets its own rounds, verdict
and (--json) final line, from the same runs (one command measuring several rates once per side per round).
Readings must be >= 0 (they are divided). A run that fails or prints no reading stops everything: exit 2,
naming the side, the round, the exit code and the tail of its stderr.

It prints each round's readings and head/base, the median ratio, the noise band and a verdict: "within
noise" or "changed (head/base higher|lower)"; --json adds one final JSON line with all of it.
Exit status: 0 it ran (whatever the verdict; 1 with --fail-on-change when changed), 2 bad usage, a bad
REV, a failed build or a failed command.

The noise rule is `verdict` (its docstring; README "A/B against another revision"): changed only when the
median ratio is further from 1 than the noise band (the sides' own scatter, the ratios' own scatter,
--tolerance: the largest) AND enough rounds agree on the side of 1 that a sign test rejects "no change"
at SIGN_ALPHA.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: this tree's packages
from systems import safe_tar  # noqa: E402
# the noise rule, one place for every comparison (scripts/regress.py, runners/compare.py)
from runners.records import resolve_rev  # noqa: E402,F401
from runners.noise import MAD_SIGMA, SIGN_ALPHA, _ratio, _rel_spread, min_rounds, rounds_needed, verdict  # noqa: E402,F401
ROUNDS = 5  # the default: the fewest rounds with which the sign test can say "changed" at SIGN_ALPHA
TAIL_LINES = 15  # lines of a failed command's stderr shown


# ---------------------------------------------------------------- exporting and building a revision


def build(tree: Path, what: str) -> str | None:
    """Builds the C++ kernel in `tree` in place with this Python (where it has a setup.py); None when done
    (or nothing to build), else why not."""
    if not (tree / "setup.py").exists():
        return None
    b = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, capture_output=True, text=True)
    return None if b.returncode == 0 else f"building {what} failed: {b.stderr.strip()[-300:]}"


def export_build(rev: str, dest: Path, repo: Path = ROOT, build_kernel: bool = True) -> str | None:
    """Exports commit `rev` of `repo` into dest (git archive, checked extraction) and builds its kernel
    there (the same environment); None when it is ready, else why not."""
    try:
        tar = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", rev],
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", b"") or b""
        return f"git archive {rev} failed ({err.decode(errors='replace').strip() or e!s})"
    try:
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            safe_tar.extract(t, dest)  # checked members, on every Python the project allows
    except (ValueError, tarfile.TarError, OSError) as e:
        return f"extracting {rev} failed: {e}"
    return build(dest, rev) if build_kernel else None


# ---------------------------------------------------------------- running the command


class CommandFailed(Exception):
    pass


def reading(stdout: str, key: str | None) -> float | None:
    """The last stdout line that is a number, or (key) the last JSON object line holding key (dotted:
    nested) with a number there."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line:
            continue
        if key is None:
            try:
                v = float(line)
            except ValueError:
                continue
            if math.isfinite(v):
                return v
            continue
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        v = _lookup(obj, key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


def _lookup(obj, key: str):
    if not isinstance(obj, dict):
        return None
    if key in obj:
        return obj[key]
    first, dot, rest = key.partition(".")
    return _lookup(obj.get(first), rest) if dot and first in obj else None


def run_side(cmd: list[str], side: str, tree: Path, rnd: int, keys: list[str | None], timeout: float | None,
             trees: dict[str, Path]) -> dict[str | None, float]:
    """One run of the command on one side: its reading for each key."""
    env = {**os.environ, "AB_SIDE": side, "AB_TREE": str(tree), "AB_ROUND": str(rnd), "AB_PYTHON": sys.executable,
           "AB_BASE_TREE": str(trees["base"]), "AB_HEAD_TREE": str(trees["head"]),
           "PYTHONPATH": os.pathsep.join([str(tree)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    argv = ["sh", "-c", cmd[0]] if len(cmd) == 1 else cmd
    where = f"the {side} command (round {rnd}, in {tree})"
    try:
        p = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CommandFailed(f"{where} ran past --timeout {timeout:g} s") from None
    except OSError as e:
        raise CommandFailed(f"{where} could not start: {e}") from None
    if p.returncode != 0:
        raise CommandFailed(f"{where} failed with exit code {p.returncode}{_tail(p.stderr, 'stderr')}")
    out = {}
    for key in keys:
        v = reading(p.stdout, key)
        if v is None:
            wanted = f"a JSON object line with {key!r}" if key else "a line that is a number"
            raise CommandFailed(f"{where} exited 0 but printed no reading ({wanted})"
                                f"{_tail(p.stdout, 'stdout')}{_tail(p.stderr, 'stderr')}")
        if v < 0:
            raise CommandFailed(f"{where} read {v!r}: readings must be >= 0 to be divided")
        out[key] = v
    return out


def _tail(text: str, name: str) -> str:
    lines = text.rstrip().splitlines()[-TAIL_LINES:]
    return f"\n  last {name} lines:\n" + "\n".join(f"    {l}" for l in lines) if lines else f"\n  ({name} empty)"


def _num(v):
    return v if not isinstance(v, float) or math.isfinite(v) else None  # JSON has no inf


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    else:
        cmd = []
    ap = argparse.ArgumentParser(prog="ab.py", usage="%(prog)s --base REV [options] -- COMMAND...",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the revision to compare with (anything git rev-parse takes)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"alternations of the two sides (default {ROUNDS})")
    ap.add_argument("--key", action="append", help="read NAME from the last JSON object line holding it (dotted: "
                    "nested); several --key: each judged on its own, from the same runs")
    ap.add_argument("--tolerance", type=float, default=0.0, metavar="PCT",
                    help="the least change, in percent, that may count as changed (default 0: the noise alone)")
    ap.add_argument("--json", action="store_true", help="also print one final JSON line with everything")
    ap.add_argument("--fail-on-change", action="store_true", help="exit 1 when the verdict is changed")
    ap.add_argument("--no-build", action="store_true", help="do not build the kernel (setup.py build_ext) of either side")
    ap.add_argument("--timeout", type=float, help="seconds one run of the command may take")
    ap.add_argument("--repo", type=Path, default=ROOT, help="the repository (default: the one holding this script)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    if not cmd:
        print("ab: no command: give it after --, e.g. ab.py --base HEAD~1 -- python bench.py", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"ab: --rounds must be at least 1, got {args.rounds}", file=sys.stderr)
        return 2
    if args.tolerance < 0:
        print(f"ab: --tolerance must be >= 0, got {args.tolerance}", file=sys.stderr)
        return 2
    repo = args.repo.resolve()
    try:
        top = subprocess.run(["git", "-C", str(repo), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
        head_tree = Path(top)
        sha = resolve_rev(args.base, head_tree)
    except (OSError, subprocess.CalledProcessError):
        print(f"ab: {repo} is not a git working tree", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"ab: bad --base: {e}", file=sys.stderr)
        return 2
    status = subprocess.run(["git", "-C", str(head_tree), "status", "--porcelain"], capture_output=True, text=True).stdout
    dirty = len(status.splitlines())
    head_sha = subprocess.run(["git", "-C", str(head_tree), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "no commit"
    if args.rounds < min_rounds():
        print(f"ab: note: with {args.rounds} round(s) the verdict cannot be 'changed' (the sign test needs "
              f">= {min_rounds()} rounds)", file=sys.stderr)
    shown = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
    with tempfile.TemporaryDirectory(prefix="ab-base-") as tmp:
        base_tree = Path(tmp)
        why = export_build(sha, base_tree, head_tree, build_kernel=not args.no_build)
        if why is None and not args.no_build:
            why = build(head_tree, "the head (working tree)")
        if why:
            print(f"ab: {why}", file=sys.stderr)
            return 2
        print(f"ab: base {args.base} = {sha[:12]}, exported to {base_tree}"
              + ("" if args.no_build else " and built"))
        print(f"ab: head = working tree {head_tree} (HEAD {head_sha}, {dirty} uncommitted change(s))")
        keys = args.key or [None]
        print(f"ab: command: {shown}" + (f"  [reading --key {', '.join(keys)}]" if args.key else ""))
        print(f"ab: {args.rounds} round(s), ABBA order\n")
        named = len(keys) > 1
        print(f"{'round':>5}  " + (f"{'key':<24}  " if named else "") + f"{'base':>12}  {'head':>12}  {'head/base':>9}")
        readings = {k: {"base": [], "head": []} for k in keys}
        sides = (("base", base_tree), ("head", head_tree))
        try:
            for rnd in range(1, args.rounds + 1):
                for side, tree in (sides if rnd % 2 else sides[::-1]):
                    got = run_side(cmd, side, tree, rnd, keys, args.timeout, {"base": base_tree, "head": head_tree})
                    for k in keys:
                        readings[k][side].append(got[k])
                for k in keys:
                    b, h = readings[k]["base"][-1], readings[k]["head"][-1]
                    print(f"{rnd:>5}  " + (f"{k:<24}  " if named else "") + f"{b:>12.6g}  {h:>12.6g}  "
                          f"{_ratio(h, b):>9.4f}", flush=True)
        except CommandFailed as e:
            print(f"ab: {e}", file=sys.stderr)
            return 2
    changed = False
    for k in keys:
        if named:
            print(f"\n== {k}", end="")
        changed |= report(args, k, readings[k]["base"], readings[k]["head"], sha, head_tree, head_sha, dirty, shown)
    return 1 if args.fail_on_change and changed else 0


def report(args, key, base_v: list[float], head_v: list[float], sha: str, head_tree: Path, head_sha: str, dirty: int,
           shown: str) -> bool:
    """One key's verdict, printed (and its JSON line with --json); True when changed."""
    v = verdict(base_v, head_v, tolerance=args.tolerance / 100)
    nz = v["noise"]
    print(f"\nmedian head/base {v['median_ratio']:.4f}; noise band +-{100 * v['band']:.2f}% (the larger of: "
          f"the sides' own scatter combined {100 * math.hypot(nz['base'], nz['head']):.2f}% (base "
          f"{100 * nz['base']:.2f}%, head {100 * nz['head']:.2f}%), the ratios' scatter {100 * nz['ratio']:.2f}%"
          + (f", tolerance {args.tolerance:g}%" if args.tolerance else "") + ")")
    print(f"verdict: {v['verdict']}: {v['why']}")
    if args.json:
        out = {"base": {"rev": args.base, "commit": sha, "readings": base_v},
               "head": {"tree": str(head_tree), "commit": head_sha, "uncommitted": dirty, "readings": head_v},
               "command": shown, "key": key,
               **{k: v[k] for k in ("rounds", "median_ratio", "band", "noise", "tolerance", "agree",
                                    "agree_needed", "changed", "direction", "verdict", "why")},
               "ratios": [_num(r) for r in v["ratios"]]}
        out["median_ratio"], out["band"] = _num(out["median_ratio"]), _num(out["band"])
        out["noise"] = {k: _num(x) for k, x in out["noise"].items()}
        print(json.dumps(out))
    return v["changed"]


if __name__ == "__main__":
    sys.exit(main())
