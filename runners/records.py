"""Benchmark records: one JSON object per measured configuration.

Schema (version 1; keys are stable, new keys may be added in a minor revision):

    schema_version, run_id, time, status, reason,
    system, workload, environment, model, mode, point{input_len, output_len, beam_width},
    config_hash, config (resolved), code{version, commit, dirty}, host{...}, versions{...},
    environment_info{described, budget_emulated, simulated},
    method{timer, sync, warmup, repetitions, token_accounting, isolation},
    metrics{ttft_s, prefill_tok_s, decode_tok_s, e2e_tok_s, tokens, valid, *_sd, best{...}},
    raw{ttft_s[], decode_s[], tokens[]}, stats{...}, system_info{...}, seeds{...}

Writes are crash-safe: a run directory's files are replaced atomically (temporary file + rename)
and index appends are whole lines, flushed and fsync'ed under a file lock, so concurrent launcher
workers and killed processes never leave a half-written line.
"""
from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable

from filelock import FileLock

SCHEMA_VERSION = 1
STATUSES = ("ok", "skipped", "error", "oom", "timeout", "interrupted")
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def default_index_path() -> Path:
    return PROJECT_ROOT / "results" / "index.jsonl"


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """Git commit and dirty flag; a dirty tree's version includes a hash of its diff."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=30, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
        version = commit[:12]
        if dirty:
            version += "+dirty." + hashlib.sha256(git("diff", "HEAD").encode()).hexdigest()[:8]
        return {"version": version, "commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version as pkg_version

        try:
            return {"version": pkg_version("fiddler-moe"), "commit": None, "dirty": None}
        except PackageNotFoundError:
            return {"version": "unknown", "commit": None, "dirty": None}


def library_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version as pkg_version

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "hydra-core", "llama-cpp-python", "deepspeed", "deepspeed-mii",
                "fiddler-moe"):
        try:
            out[pkg] = pkg_version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def config_hash(config: dict[str, Any], point: dict[str, Any]) -> str:
    """Identity of a measurement: what ran (config minus run control), where, and with which code."""
    measured = {k: v for k, v in config.items() if k not in ("run", "cache_dir")}
    # the workload's lists only say which points exist; the point itself is hashed below, so a
    # sweep that gains a point keeps the hashes of the points it already had (resume)
    measured["workload"] = {k: v for k, v in config["workload"].items()
                            if k not in ("input_lens", "output_lens", "beam_widths")}
    blob = json.dumps({"config": measured, "point": point, "code": code_version()["version"]},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see the old or the new file, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_lines(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Append whole JSON lines under an inter-process lock, flushed and synced."""
    lines = "".join(json.dumps(r, default=str) + "\n" for r in records)
    if not lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        with open(path, "a") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())


def read_jsonl(path: Path, *, strict: bool = False) -> list[dict[str, Any]]:
    """Records of a JSONL file. A damaged line is reported (warning naming file and line) and skipped."""
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                msg = f"{path}:{lineno}: damaged record line skipped ({exc})"
                if strict:
                    raise ValueError(msg) from exc
                warnings.warn(msg, stacklevel=2)
                print(f"warning: {msg}", file=sys.stderr)
                continue
            out.append(rec)
    return out


class RunRecords:
    """The records of one Hydra job: `records.jsonl` in its directory plus the project index."""

    def __init__(self, run_dir: Path, index_path: Path):
        self.run_dir = Path(run_dir)
        self.index_path = Path(index_path)
        self.records: list[dict[str, Any]] = read_jsonl(self.path)

    @property
    def path(self) -> Path:
        return self.run_dir / "records.jsonl"

    def add(self, record: dict[str, Any], *, to_index: bool = True) -> None:
        assert record["status"] in STATUSES, record["status"]
        self.records.append(record)
        atomic_write_text(self.path, "".join(json.dumps(r, default=str) + "\n" for r in self.records))
        if to_index:
            append_lines(self.index_path, [record])


def ok_records_by_hash(index_path: Path) -> dict[str, dict[str, Any]]:
    """The latest `ok` record of every config hash in the index (for resume)."""
    return {rec["config_hash"]: rec for rec in read_jsonl(index_path)
            if rec.get("status") == "ok" and rec.get("config_hash")}


def collect(paths) -> list[dict[str, Any]]:
    """Records of JSONL files (records.jsonl, the project index) and of directories holding them
    (every records.jsonl below, in path order)."""
    recs: list[dict[str, Any]] = []
    for p in map(Path, paths):
        if p.is_dir():
            for f in sorted(p.rglob("records.jsonl")):
                recs.extend(read_jsonl(f))
        elif p.is_file():
            recs.extend(read_jsonl(p))
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return recs
