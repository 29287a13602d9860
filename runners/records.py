"""Benchmark records: one JSON object per measured configuration.

Schema (version 1; keys are stable, new keys may be added in a minor revision):

    schema_version, run_id, time, status, reason,
    system, workload, environment, model, mode, point{input_len, output_len, beam_width},
    config_hash, config (resolved), code{version, commit, dirty}, host{...}, versions{...},
    environment_info{described, budget_emulated, simulated, detected{key: value}},
    method{timer, sync, warmup, repetitions, token_accounting, isolation},
    metrics{ttft_s, prefill_tok_s, decode_tok_s, e2e_tok_s, tokens, valid, *_sd, best{...}},
    raw{ttft_s[], decode_s[], tokens[]}, stats{...}, system_info{...}, seeds{...},
    timing{load_s, measure_s}

Writes are crash-safe: a run directory's files are replaced atomically (temporary file + rename)
and index appends are whole lines, flushed and fsync'ed under a file lock, so concurrent launcher
workers and killed processes never leave a half-written line. Reads survive anything: a line that is
not UTF-8, not JSON or not a usable record (:func:`record_problem`) is reported with file:line and
skipped.
"""
from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import math
import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

from filelock import FileLock

from systems import paths

SCHEMA_VERSION = 1
STATUSES = ("ok", "skipped", "error", "oom", "timeout", "interrupted")
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def default_index_path() -> Path:
    return paths.results_dir() / "index.jsonl"


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


def resolve_rev(rev: str, repo: Path = PROJECT_ROOT) -> str:
    """REV's full commit id; ValueError with git's words when it names no commit."""
    r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                       capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise ValueError(f"{rev!r} is not a commit of {repo}" + (f" ({r.stderr.strip()})" if r.stderr.strip() else ""))
    return r.stdout.strip()


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


def kernel_overrides() -> dict[str, str]:
    """The FIDDLER_KERNEL_* variables set in this process (a forced ISA path, prefetch, quantized mode...): they
    change what the kernel runs, so they are asked-for settings like the config's."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("FIDDLER_KERNEL_")}


def config_hash(config: dict[str, Any], point: dict[str, Any]) -> str:
    """Identity of a measurement: what was asked for (`identity.requested_config` minus run control, plus the
    kernel overrides of the environment: FIDDLER_KERNEL_ISA=avx2 measures another path), the point, and the
    code. Values measured at start are not in it (they are in the record)."""
    measured = {k: v for k, v in config.items() if k not in ("run", "cache_dir", "serve")}  # serve: mode=serve only
    # the workload's lists only say which points exist; the point itself is hashed below, so a
    # sweep that gains a point keeps the hashes of the points it already had (resume)
    measured["workload"] = {k: v for k, v in config["workload"].items()
                            if k not in ("input_lens", "output_lens", "beam_widths", "concurrency", "rates")}
    ident = {"config": measured, "point": point, "code": code_version()["version"]}
    if kernel_overrides():  # absent when none is set: the hashes of plain runs stay as they were
        ident["kernel_env"] = kernel_overrides()
    blob = json.dumps(ident, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see the old or the new file, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    # os.open with 0o666 lets the kernel apply the user's umask (mkstemp would force 0600)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
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


def read_jsonl(path: Path, *, strict: bool = False,
               check: Callable[[dict[str, Any]], str | None] | None = None) -> list[dict[str, Any]]:
    """JSON objects of a JSONL file. A damaged line (any bytes: not UTF-8, not JSON, not an object,
    or rejected by `check`) is reported (warning naming file and line) and skipped."""
    if not path.exists():
        return []
    with open(path, "rb") as f:  # bytes: one bad byte must cost one line, not the file
        return parse_jsonl(f, str(path), strict=strict, check=check)


def parse_jsonl(lines: Iterable[bytes], name: str, *, strict: bool = False,
                check: Callable[[dict[str, Any]], str | None] | None = None) -> list[dict[str, Any]]:
    """`read_jsonl` of lines that are not a file (e.g. `git show REV:path`); `name` is what a damaged
    line's report calls them."""
    out: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
            problem = "not a JSON object" if not isinstance(rec, dict) else check(rec) if check else None
            if problem:
                raise ValueError(problem)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            msg = f"{name}:{lineno}: damaged record line skipped ({str(exc)[:200]})"
            if strict:
                raise ValueError(msg) from exc
            warnings.warn(msg, stacklevel=3)
            print(f"warning: {msg}", file=sys.stderr)
            continue
        out.append(rec)
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _metric_problem(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if key == "best":
        ok = isinstance(value, dict) and all(v is None or _is_number(v) for v in value.values())
    elif key == "valid":
        ok = isinstance(value, bool)
    elif key in ("repetitions", "tokens"):
        ok = _is_int(value)
    else:
        ok = _is_number(value)
    return None if ok else f"metrics.{key}={value!r} is not a {'boolean' if key == 'valid' else 'number'}"


# metrics every `ok` record has (decode_tok_s is None when only one token was generated)
_OK_METRICS = ("ttft_s", "prefill_tok_s", "e2e_tok_s")

# the nested fields the readers take apart (runners/tables.py, provenance.of_record, compare.py, figures.py),
# parents before children: each is absent, null or of this kind (the kind's name, its check)
_NESTED = {
    "host": ("an object", lambda v: isinstance(v, dict)),
    "host.cpu_name": ("a string", lambda v: isinstance(v, str)),
    "environment_info": ("an object", lambda v: isinstance(v, dict)),
    "decode_bound": ("an object", lambda v: isinstance(v, dict)),
    "decode_bound.fraction": ("an object", lambda v: isinstance(v, dict)),
    "decode_bound.fraction.best": ("a number", lambda v: _is_number(v)),
    "config.environment": ("an object", lambda v: isinstance(v, dict)),
    "point.concurrency": ("an integer", lambda v: _is_int(v)),
    "point.rate": ("a number", lambda v: _is_number(v)),
    "raw": ("an object", lambda v: isinstance(v, dict)),
}


def _nested_problem(rec: dict[str, Any]) -> str | None:
    for path, (kind, ok) in _NESTED.items():
        value: Any = rec
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None and not ok(value):
            return f"{path}={json.dumps(value, default=str)[:80]} is not {kind}"
    return None


def record_problem(rec: dict[str, Any]) -> str | None:
    """Why `rec` is not a record that tables and resume can use, or None. Checks the shape they read,
    so that any JSON object is either shown correctly or reported, and never `ok` without metrics."""
    if rec.get("status") not in STATUSES:
        return f"status={rec.get('status')!r} is not one of {', '.join(STATUSES)}"
    for key in ("system", "model", "workload", "environment", "mode", "time", "reason", "run_id", "config_hash"):
        if rec.get(key) is not None and not isinstance(rec[key], str):
            return f"{key}={rec[key]!r} is not a string"
    point = rec.get("point")
    if not isinstance(point, dict) or not all(_is_int(point.get(k)) for k in ("input_len", "output_len", "beam_width")):
        return f"point={point!r} is not {{input_len, output_len, beam_width}} integers"
    for key in ("config", "metrics"):
        if rec.get(key) is not None and not isinstance(rec[key], dict):
            return f"{key} is not an object"
    nested = _nested_problem(rec)
    if nested:
        return nested
    metrics = rec.get("metrics") or {}
    if rec["status"] == "ok":
        missing = [k for k in _OK_METRICS if not _is_number(metrics.get(k))]
        if missing:
            return f"an ok record without metrics ({', '.join(missing)})"
        # a measurement makes at least one token: with none, its metrics (and `valid`) describe nothing
        raw_tokens = (rec.get("raw") or {}).get("tokens")
        counts = [metrics.get("tokens"), *(raw_tokens if isinstance(raw_tokens, list) else [])]
        if any(_is_number(n) and n < 1 for n in counts):
            return f"an ok record with 0 tokens (metrics.tokens={metrics.get('tokens')!r}, raw.tokens={raw_tokens!r})"
    problem = next(filter(None, (_metric_problem(k, v) for k, v in metrics.items())), None)
    if problem is None and rec["status"] == "ok":  # a line written before the writer refused them
        found = first_non_finite(rec)
        problem = f"an ok record with a non-finite number: {found}" if found else None
    return problem


def first_non_finite(value: Any, path: str = "") -> str | None:
    """`path=value` of the first NaN or infinite number in a record (depth first), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path}={value!r}"
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next(filter(None, (first_non_finite(v, p) for p, v in items)), None)


def _nulled(value: Any) -> Any:
    """NaN and infinities as null: what strict JSON can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nulled(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nulled(v) for v in value]
    return value


def finite_record(rec: dict[str, Any]) -> dict[str, Any]:
    """The record as written: strict JSON, and never `ok` with a NaN or an infinity. Such an `ok` record
    becomes an `error` naming the first such field, without its metrics: they were computed from it, and
    nothing tells which of them to trust. Turned into an error, not raised: the sweep goes on, the job
    exits 1, and the index keeps a line saying what went wrong instead of nothing. Non-finite numbers
    of any record are written as null (an `ok` record's index line is then never NaN-laden JSON that
    other readers choke on)."""
    found = first_non_finite(rec)
    if found is None:
        return rec
    if rec.get("status") == "ok":
        rec = {k: v for k, v in rec.items() if k not in ("metrics", "raw")}
        rec.update(status="error", reason=f"an ok record must hold finite numbers only: {found} "
                                          f"(its metrics are dropped)")
    return _nulled(rec)


def read_records(path: Path) -> list[dict[str, Any]]:
    """Benchmark records of a JSONL file; lines that are not usable records are reported and skipped."""
    return read_jsonl(path, check=record_problem)


class RunRecords:
    """The records of one Hydra job: `records.jsonl` in its directory plus the project index."""

    def __init__(self, run_dir: Path, index_path: Path):
        self.run_dir = Path(run_dir)
        self.index_path = Path(index_path)
        self.records: list[dict[str, Any]] = [finite_record(r) for r in read_records(self.path)]

    @property
    def path(self) -> Path:
        return self.run_dir / "records.jsonl"

    def add(self, record: dict[str, Any], *, to_index: bool = True) -> dict[str, Any]:
        """Writes the record as finite_record makes it, and returns that."""
        assert record["status"] in STATUSES, record["status"]
        record = finite_record(record)
        self.records.append(record)
        atomic_write_text(self.path, "".join(json.dumps(r, default=str, allow_nan=False) + "\n" for r in self.records))
        if to_index:
            append_lines(self.index_path, [record])
        return record


def ok_records(index_path: Path) -> list[dict[str, Any]]:
    """The index's `ok` records that resume can use (for resume)."""
    return [rec for rec in read_records(index_path)
            if rec["status"] == "ok" and rec.get("config_hash") and rec.get("run_id")]


def ok_records_by_hash(index_path: Path) -> dict[str, dict[str, Any]]:
    """The latest `ok` record of every config hash in the index (for resume)."""
    return {rec["config_hash"]: rec for rec in ok_records(index_path)}


def recorded_by_other_code(oks: Iterable[dict[str, Any]], requested: dict[str, Any],
                           points: list[dict[str, Any]]) -> dict[str, int]:
    """Code version -> how many of these points have an ok record of this system, model, workload,
    environment and mode from other code. A config hash includes the code (`config_hash`), so such records never
    resume: what resume tells the user when a sweep recorded at another commit (before a move of the code, or
    any change) is measured again."""
    ours = code_version()["version"]
    keys = (requested["system"]["name"], requested["model"]["name"], requested["workload"]["name"],
            requested["environment"]["name"], requested["mode"])
    out: dict[str, int] = {}
    for rec in oks:
        version = (rec.get("code") or {}).get("version")
        if version != ours and (rec.get("system"), rec.get("model"), rec.get("workload"), rec.get("environment"),
                                rec.get("mode")) == keys and rec.get("point") in points:
            out[str(version)] = out.get(str(version), 0) + 1
    return out


def collect(paths) -> list[dict[str, Any]]:
    """Records of JSONL files (records.jsonl, the project index) and of directories holding them (every
    records file below, in path order: records.jsonl, and names such as records-2.jsonl or
    fiddler.records.jsonl as committed under results/measured); damaged lines are reported and skipped."""
    recs: list[dict[str, Any]] = []
    for p in map(Path, paths):
        if p.is_dir():
            for f in sorted(p.rglob("*records*.jsonl")):
                recs.extend(read_records(f))
        elif p.is_file():
            recs.extend(read_records(p))
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return recs
