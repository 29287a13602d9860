"""A guard over the whole session: no `ok` record that a test wrote holds a NaN or an infinity (issue 20).

At the end of the session every `records.jsonl` is read back strictly (a `NaN`/`Infinity` token, or a
literal such as 1e999 that parses as infinity, is caught): those under pytest's temporary directories
(where the tests' jobs and `python run.py` children write), those the runner wrote in this process
wherever they are (read after each write too, as some are in temporary directories removed before the
end), and those under results/runs and results/multirun written during the session. Only `records.jsonl`
files: every record the writer writes goes there (the index gets a copy), while index files also hold
lines that tests write by hand to prove the readers skip them (tests/test_records_robust.py). The last
line of the report gives the count; reading fewer records than the runner wrote in this process fails
the session too, so a walk that sees nothing cannot pass unnoticed.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Walk:
    files: int = 0
    records: int = 0
    ok: int = 0
    problems: list[str] = field(default_factory=list)

    def __iadd__(self, other: Walk) -> Walk:
        self.files, self.records, self.ok = self.files + other.files, self.records + other.records, self.ok + other.ok
        self.problems += other.problems
        return self


def _first_non_finite(value: Any, path: str = "") -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path}={value!r}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _first_non_finite(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if found:
            return found
    return None


def walk_file(path: Path) -> Walk:
    """One records.jsonl, read strictly: NaN/Infinity tokens are noted, not just parsed."""
    walk = Walk(files=1)
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        tokens: list[str] = []
        try:
            rec = json.loads(line, parse_constant=lambda t: tokens.append(t) or float(t))
        except ValueError as exc:
            walk.problems.append(f"{path}:{lineno}: not JSON ({exc})")
            continue
        walk.records += 1
        if not isinstance(rec, dict) or rec.get("status") != "ok":
            continue
        walk.ok += 1
        found = _first_non_finite(rec)
        if tokens or found:
            walk.problems.append(f"{path}:{lineno}: an ok record with {found or tokens[0]}")
    return walk


def record_files(roots: Iterable[Path], since: float | None = None) -> set[Path]:
    """Every records.jsonl under `roots` (modified after `since` where given)."""
    return {p.resolve() for root in map(Path, roots) if root.is_dir() for p in root.rglob("records.jsonl")
            if since is None or p.stat().st_mtime >= since}


def walk_records(roots: Iterable[Path]) -> Walk:
    walk = Walk()
    for path in sorted(record_files(roots)):
        walk += walk_file(path)
    return walk


@pytest.fixture(scope="session", autouse=True)
def no_ok_record_is_non_finite(request, tmp_path_factory):
    """Walks the session's records (see the module's docstring). Files the runner writes in this process
    are walked after every write too: some live in temporary directories gone by the session's end
    (runners.validate_sim)."""
    from runners import records

    seen: dict[Path, Walk] = {}  # the latest walk of each file
    added = [0]
    add = records.RunRecords.add

    def walking_add(self, record, *, to_index=True):
        written = add(self, record, to_index=to_index)
        added[0] += 1
        seen[self.path.resolve()] = walk_file(self.path)
        return written

    start = time.time() - 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(records.RunRecords, "add", walking_add)
        yield
    files = record_files([tmp_path_factory.getbasetemp()])
    files |= record_files([ROOT / "results" / "runs", ROOT / "results" / "multirun"], since=start)
    files |= {p for p in seen if p.is_file()}
    seen.update({p: walk_file(p) for p in files})
    walk = Walk()
    for path in sorted(seen):
        walk += seen[path]
    problems = list(walk.problems)
    if walk.records < added[0]:  # each add writes a line; a walk that misses files must not pass
        problems.append(f"the walk read {walk.records} records, fewer than the {added[0]} written in this process")
    line = (f"record walk: {walk.records} records ({walk.ok} ok) in {walk.files} records.jsonl files, "
            f"{len(problems)} problem(s)")
    request.config.stash[_SUMMARY] = [line, *problems[:20]]
    if problems:
        raise AssertionError(f"{line}:\n" + "\n".join(problems[:20]))


_SUMMARY = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(_SUMMARY, None)
    for extra in (lines or [])[1:]:
        terminalreporter.write_line(f"  {extra}")
    if lines:
        terminalreporter.write_line(lines[0])
