"""Running a job's configurations in a fresh child process (`run.isolation=process`, and every job
that sets a limit).

The child loads the system once and measures points in order, telling the parent over a pipe when
the load is done, when each point starts and each finished record. The parent alone writes records
and enforces the limits: `run.memory_limit_gb` is the child's RLIMIT_AS, `run.load_timeout_s` bounds
the load (from when the child is ready) and `run.timeout_s` each configuration, timed apart. When the child dies (crash, OS memory
limit, kill) or a point exceeds its time, the parent writes an `error` / `oom` / `timeout` record for
the point that was running and starts a new child for the rest, so one bad configuration never loses
the others. A failure while loading is the same for every point, so it is recorded for all of them
without starting the system again.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator

from runners.session import (OOM_TEXT, Job, Session, base_record, classify_failure, load_failed, memory_limit_text,
                             timing)

_CTX = mp.get_context("spawn")  # a fresh interpreter: no state (threads, CUDA, allocator) inherited


def _child_main(job: Job, todo: list[int], conn, stderr) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt means
    os.dup2(stderr.fileno(), 2)  # to the parent, which passes it on and keeps the end for a death reason
    if job.memory_limit_gb:
        import resource

        limit = int(job.memory_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        conn.send(("loading", None))  # the load's time limit starts here, not at the interpreter's start
        session = Session(job, on_progress=lambda msg: conn.send(("progress", msg)))
        session.load()
        if session.failed:  # the parent records it for every point: nothing more to do in a failed child
            conn.send(("fatal", session.failed))
            return
        conn.send(("loaded", session.load_s))
        for index in todo:
            conn.send(("start", index))
            conn.send(("record", (index, session.measure(index))))
        session.close()
    except BaseException as exc:  # e.g. a MemoryError under the limit outside the session's own handling
        conn.send(("fatal", classify_failure(exc, job.memory_limit_gb)))
    finally:
        conn.close()


class _StderrTail:
    """The child's stderr, passed on to ours as it comes, with its last bytes kept: a process that
    cannot allocate below Python (the dynamic loader under RLIMIT_AS: "cannot allocate memory for
    thread-local data", exit 127) says so only there."""

    def __init__(self, conn):
        self.tail = b""
        self._thread = threading.Thread(target=self._pump, args=(conn,), daemon=True)
        self._thread.start()

    def _pump(self, conn) -> None:
        with conn:
            while chunk := os.read(conn.fileno(), 65536):
                os.write(2, chunk)
                self.tail = (self.tail + chunk)[-4096:]

    def last_line(self) -> str:
        self._thread.join(2)  # the rest of a dead child's output
        lines = [line.strip() for line in self.tail.decode(errors="replace").splitlines() if line.strip()]
        return lines[-1][:200] if lines else ""


def _death_reason(exitcode: int, last_line: str, memory_limit_gb: float | None) -> tuple[str, str]:
    said = f" ({last_line})" if last_line else ""
    how = f"died with {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exited with status {exitcode}"
    # an allocation failure below Python says so only on stderr: the dynamic loader (exit 127) or C++
    # `new` under RLIMIT_AS (std::bad_alloc, then abort: SIGABRT)
    if any(t in last_line.lower() for t in OOM_TEXT):
        return "oom", f"out of memory ({memory_limit_text(memory_limit_gb)}): child process {how}{said}"
    if exitcode == -signal.SIGKILL:
        return "oom", (f"child process killed by SIGKILL (likely out of memory; "
                       f"{memory_limit_text(memory_limit_gb)})")
    if exitcode < 0:
        return "error", f"child process {how}{said}"
    return "error", f"child process exited with status {exitcode} before finishing the configuration{said}"


def _spawnable_start_method() -> None:
    """A spawned child sets up multiprocessing with its parent's start method. In a joblib (loky)
    worker that is "loky", which a fresh interpreter does not know ("cannot find context for 'loky'"),
    so such a worker's default becomes "spawn", the method the child is started with anyway."""
    if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
        mp.set_start_method("spawn", force=True)


def start_in_env(proc, process_env: dict[str, str], unset: tuple[str, ...] = ()) -> None:
    """Start a spawned process with the system's environment (`SystemAdapter.process_env`, read once when
    torch or llama.cpp loads) and without `unset`: a spawned child takes the parent's environment at start,
    which is restored right after. The one way the harness and the regression suite give a system its process."""
    saved = {k: os.environ.get(k) for k in (*process_env, *unset)}
    for k in unset:
        os.environ.pop(k, None)
    os.environ.update(process_env)
    try:
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start(job: Job, todo: list[int]):
    _spawnable_start_method()
    parent_conn, child_conn = _CTX.Pipe(duplex=False)
    err_read, err_write = _CTX.Pipe(duplex=False)
    proc = _CTX.Process(target=_child_main, args=(job, todo, child_conn, err_write), daemon=True)
    start_in_env(proc, job.process_env)
    child_conn.close()
    err_write.close()
    return proc, parent_conn, _StderrTail(err_read)


def _next_message(proc, conn, deadline: float | None) -> tuple[str, Any]:
    """The child's next message, ("died", None) when it is gone, or ("late", None) at the deadline."""
    while True:
        wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
        if conn.poll(wait):
            try:
                return conn.recv()
            except EOFError:
                return "died", None
        if not proc.is_alive() and not conn.poll():
            return "died", None
        if deadline is not None and time.monotonic() >= deadline:
            return "late", None


def run_isolated(job: Job, todo: list[int], *, timeout_s: float | None, load_timeout_s: float | None,
                 on_event: Callable[[str, Any], None]) -> Iterator[dict[str, Any]]:
    """Yield one record per index in `todo`, whatever happens to the child processes."""
    remaining = list(todo)
    while remaining:
        proc, conn, stderr = _start(job, remaining)
        current: int | None = None  # the configuration running; None while the system loads
        load_s: float | None = None
        started = time.monotonic()
        try:
            while remaining:
                limit = timeout_s if current is not None else load_timeout_s if load_s is None else None
                kind, payload = _next_message(proc, conn, None if limit is None else started + limit)
                if kind == "loading":
                    started = time.monotonic()
                elif kind == "loaded":
                    load_s, started = payload, time.monotonic()
                elif kind == "start":
                    current, started = payload, time.monotonic()
                    on_event("start", payload)
                elif kind == "record":
                    index, record = payload
                    remaining.remove(index)
                    current = None
                    yield record
                elif kind == "progress":
                    on_event("progress", payload)
                else:  # "fatal", "died" or "late": this child is done
                    if kind == "fatal":
                        status, reason = payload
                    elif kind == "died":
                        proc.join(5)
                        status, reason = _death_reason(proc.exitcode if proc.exitcode is not None else 1,
                                                       stderr.last_line(), job.memory_limit_gb)
                    elif current is not None:
                        status, reason = "timeout", f"configuration exceeded run.timeout_s={timeout_s:g}"
                    else:
                        status, reason = "timeout", f"system load exceeded run.load_timeout_s={load_timeout_s:g}"
                    if current is None and load_s is None:
                        reason = load_failed(job, reason)
                    elapsed = time.monotonic() - started
                    # a failed load fails every point; between points it is charged to the next one
                    failed = [current] if current is not None else list(remaining) if load_s is None \
                        else remaining[:1]
                    for index in failed:
                        remaining.remove(index)
                        rec = base_record(job, index, status, reason)
                        rec["timing"] = timing(load_s if load_s is not None else elapsed,
                                               elapsed if current is not None else None)
                        yield rec
                    break  # a new child for the rest, if any
        finally:
            _stop(proc)
            conn.close()
            if current is not None and current in remaining:
                on_event("abandoned", current)


def _stop(proc) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(3)
    if proc.is_alive():
        proc.kill()
        proc.join(3)
