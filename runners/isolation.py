"""Running a job's configurations in a fresh child process (`run.isolation=process`).

The child loads the system once and measures points in order, telling the parent over a pipe when
each point starts and sending each finished record. The parent alone writes records. When the child
dies (crash, OS memory limit, kill) or a point exceeds `run.timeout_s`, the parent writes an
`error` / `oom` / `timeout` record for the point that was running and starts a new child for the
rest, so one bad configuration never loses the others.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any, Callable, Iterator

from baselines.base import one_line
from runners.session import Job, Session, base_record, classify_failure

_CTX = mp.get_context("spawn")  # a fresh interpreter: no state (threads, CUDA, allocator) inherited


def _child_main(job: Job, todo: list[int], conn, memory_limit_gb: float | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt means
    if memory_limit_gb:
        import resource

        limit = int(memory_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        conn.send(("loading", None))
        session = Session(job, on_progress=lambda msg: conn.send(("progress", msg)))
        session.load()
        for index in todo:
            conn.send(("start", index))
            conn.send(("record", (index, session.measure(index))))
        session.close()
    except BaseException as exc:  # load failures (a MemoryError under the limit, import errors, ...)
        conn.send(("fatal", (classify_failure(exc), one_line(exc))))
    finally:
        conn.close()


def _signal_reason(exitcode: int, memory_limit_gb: float | None) -> tuple[str, str]:
    if exitcode < 0:
        sig = signal.Signals(-exitcode).name
        if sig == "SIGKILL":
            return "oom", f"child process killed by SIGKILL (likely out of memory; run.memory_limit_gb={memory_limit_gb})"
        return "error", f"child process died with {sig}"
    return "error", f"child process exited with status {exitcode} before finishing the configuration"


def run_isolated(job: Job, todo: list[int], *, timeout_s: float | None, memory_limit_gb: float | None,
                 on_event: Callable[[str, Any], None]) -> Iterator[dict[str, Any]]:
    """Yield one record per index in `todo`, whatever happens to the child processes."""
    remaining = list(todo)
    while remaining:
        parent_conn, child_conn = _CTX.Pipe(duplex=False)
        proc = _CTX.Process(target=_child_main, args=(job, remaining, child_conn, memory_limit_gb), daemon=True)
        saved = {k: os.environ.get(k) for k in job.process_env}
        os.environ.update(job.process_env)  # a spawned child inherits the environment at start
        try:
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child_conn.close()
        current: int | None = None
        started = time.monotonic()
        try:
            while remaining:
                deadline = None if timeout_s is None else started + timeout_s
                wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                if parent_conn.poll(wait):
                    try:
                        kind, payload = parent_conn.recv()
                    except EOFError:
                        kind, payload = "eof", None
                else:
                    kind, payload = "idle", None
                if kind == "start":
                    current, started = payload, time.monotonic()
                    on_event("start", payload)
                elif kind == "record":
                    index, record = payload
                    remaining.remove(index)
                    current = None
                    yield record
                elif kind == "progress":
                    on_event("progress", payload)
                elif kind == "fatal":
                    status, reason = payload
                    for index in list(remaining):
                        remaining.remove(index)
                        yield base_record(job, index, status, reason)
                elif kind == "eof" or (kind == "idle" and not proc.is_alive() and not parent_conn.poll()):
                    proc.join(5)
                    index = current if current is not None else remaining[0]
                    status, reason = _signal_reason(proc.exitcode if proc.exitcode is not None else 1,
                                                    memory_limit_gb)
                    remaining.remove(index)
                    yield base_record(job, index, status, reason)
                    break  # start a new child for the rest
                if deadline is not None and time.monotonic() >= deadline and remaining:
                    index = current if current is not None else remaining[0]
                    _stop(proc)
                    remaining.remove(index)
                    phase = "configuration" if current is not None else "system load"
                    yield base_record(job, index, "timeout", f"{phase} exceeded run.timeout_s={timeout_s}")
                    break
        finally:
            _stop(proc)
            parent_conn.close()
            if current is not None and current in remaining:
                on_event("abandoned", current)


def _stop(proc) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(3)
    if proc.is_alive():
        proc.kill()
        proc.join(3)
