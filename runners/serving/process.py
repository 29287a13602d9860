"""Child processes that never outlive the run: a system's server (mode=serve, workload=serving) and the load
generator. The one place that starts and stops them, so the rules hold for both:

- Each child leads a session of its own (so its own process group): stopping it signals every process it
  started (guidellm's spawn workers and resource tracker, a server's workers), and a terminal's Ctrl-C reaches
  only this process, which decides what it means.
- When this process dies, even of SIGKILL, which no handler sees, the group goes too: on Linux the child gets
  a parent-death signal (prctl PR_SET_PDEATHSIG; the kernel ties it to the thread that started the child, so
  children are started from a thread that lives as long as they do: the main thread, here), and for what the
  child started, which no parent-death signal reaches, a guard (a shell reading a pipe only this process
  writes) kills the whole group when the pipe closes: at stop(), or when this process dies in any way.
- A server counts as ready only when it is ours: its port is checked free before it starts (a clear error,
  never "ready" for whoever holds the port), and readiness needs the child alive and its process tree holding
  the listening socket. A load failure that /health reports, or an early exit, ends the wait at once, with
  the reason.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable

_PR_SET_PDEATHSIG = 1


class ServerFailed(RuntimeError):
    """The server did not become ready (or is not ours); the message says why."""


class PortUnavailable(ServerFailed):
    """Nothing was started: the port is taken, or the host cannot be listened on."""


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn giving the child SIGKILL when this process dies (Linux; elsewhere None). SIGKILL, not
    SIGTERM: with the parent gone nothing records what a draining server would finish, and a server that
    drains slowly or ignores SIGTERM must not linger."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: nothing to resolve between fork and exec
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect: nobody would stop us
            os._exit(1)

    return preexec


# the guard of each running child's group, by the child's pid (= its group's id)
_guards: dict[int, subprocess.Popen] = {}


def start(cmd: list[str], **popen_kw) -> subprocess.Popen:
    """cmd in its own session, its group dying with this process (see the module's docstring). Pair every
    start with a stop(), which also ends the group's guard."""
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent(), **popen_kw)
    # its own session too (a terminal's signals do not reach it), and no parent-death signal: it must
    # outlive this process to do its work
    _guards[proc.pid] = subprocess.Popen(["sh", "-c", 'read _; kill -s KILL -- "-$1" 2>/dev/null', "guard",
                                          str(proc.pid)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
    return proc


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child leads its group: pgid == pid
    except ProcessLookupError:
        pass  # the whole group is gone


def stop(proc: subprocess.Popen, grace_s: float, sig: int = signal.SIGTERM) -> int:
    """Send sig to the child's process group, give the child grace_s to exit, then SIGKILL whatever is left
    of the group (the child, if it did not exit; the workers it left behind, if it did). Its exit status."""
    _signal_group(proc, sig)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc, signal.SIGKILL)
    rc = proc.wait()
    guard = _guards.pop(proc.pid, None)
    if guard is not None:  # the group is gone: its guard's kill finds nothing, and it exits
        guard.stdin.close()
        guard.wait()
    return rc


def port_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (a trial bind fails), or None. SO_REUSEADDR as servers set
    it: a port held only by connections closing (TIME_WAIT) is free."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return f"{host}:{port} is already in use (another process listens there)"
        return f"cannot listen on {host}:{port} ({e.strerror or e})"
    return None


def probe(host: str, port: int, path: str, timeout: float = 5.0, limit: int | None = 64 * 1024) -> tuple[int | None, str]:
    """(HTTP status, body: its first `limit` bytes) of GET path; (None, why) when nothing answers."""
    try:
        c = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read(limit).decode(errors="replace")
        finally:
            c.close()
    except OSError as e:
        return None, str(e)


def load_error(body: str) -> str | None:
    """The reason a /health body gives for a failed load (fiddler.server: {"status": "error", "error": ...})."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if isinstance(data, dict) and data.get("status") == "error":
        return str(data.get("error") or body)
    return None


class ServerProcess:
    """A system's server in a child process (start), ready when ours answers (wait_ready), stopped with
    SIGTERM, which it gets to drain (stop). Its output goes to `log` where given (tail() reads it), else
    stdout is this process's and stderr passes through this process, its last lines kept for tail()."""

    def __init__(self, cmd: list[str], env: dict[str, str], host: str, port: int, health_path: str,
                 log: Path | None = None):
        self.cmd, self.host, self.port, self.health_path, self.log = cmd, host, port, health_path, log
        problem = port_problem(host, port)
        if problem:
            raise PortUnavailable(problem)
        self._lines: collections.deque[str] = collections.deque(maxlen=40)
        self._pump_thread: threading.Thread | None = None
        if log is not None:
            with log.open("w") as out:
                self.proc = start(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        else:
            self.proc = start(cmd, env=env, stderr=subprocess.PIPE)
            self._pump_thread = threading.Thread(target=self._pump, args=(self.proc.stderr,), daemon=True)
            self._pump_thread.start()

    def _pump(self, pipe: IO[bytes]) -> None:
        for raw in pipe:
            line = raw.decode(errors="replace")
            sys.stderr.write(line)
            sys.stderr.flush()
            self._lines.append(line)

    def tail(self, n: int = 2000) -> str:
        if self.log is not None:
            try:
                return self.log.read_text(errors="replace")[-n:]
            except OSError:
                return ""
        return "".join(self._lines)[-n:]

    def _owns_port(self) -> bool | None:
        """Whether the child's process tree holds the listening socket; None where that cannot be told."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port
                       for c in p.net_connections(kind="tcp")):
                    return True
            return False
        except psutil.NoSuchProcess:
            return False
        except (psutil.AccessDenied, NotImplementedError):
            return None

    def _exited(self) -> str:
        if self._pump_thread is not None:
            self._pump_thread.join(2)  # its last words, still in the pipe
        last = [line.strip() for line in self.tail().splitlines() if line.strip()]
        return (f"the server exited with {self.proc.returncode} before it was ready"
                + (f"; its last output: {last[-1][:500]}" if last else ""))

    def check_ready(self) -> bool:
        """True once our server answers its health route; ServerFailed when it exited, reports a failed load,
        or the answer comes from a process that is not ours."""
        if self.proc.poll() is not None:
            raise ServerFailed(self._exited())
        status, body = probe(self.host, self.port, self.health_path)
        if status == 200:
            if self._owns_port() is False:
                if self.proc.poll() is not None:  # it failed to bind and exited meanwhile
                    raise ServerFailed(self._exited())
                raise ServerFailed(f"{self.host}:{self.port} answers, but not from the server started here "
                                   f"(pid {self.proc.pid}): another process took the port")
            return True
        reason = load_error(body) if status is not None else None
        if reason:
            raise ServerFailed(f"the model failed to load: {reason}")
        return False

    def wait_ready(self, timeout_s: float, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Until check_ready; False if cancelled() first; ServerFailed past timeout_s."""
        end = time.monotonic() + timeout_s
        while not self.check_ready():
            if cancelled():
                return False
            if time.monotonic() > end:
                raise ServerFailed(f"the server did not answer {self.health_path} within {timeout_s:g} s")
            time.sleep(0.25)
        return True

    def metrics_text(self) -> str | None:
        status, body = probe(self.host, self.port, "/metrics", timeout=10, limit=None)
        return body if status == 200 else None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """sig to the server's process group (a first SIGTERM starts its drain)."""
        if self.proc.poll() is None:
            _signal_group(self.proc, sig)

    def stop(self, grace_s: float) -> int:
        """SIGTERM (the server drains), grace_s to exit, then SIGKILL to what is left of its group."""
        return stop(self.proc, grace_s)


def server_context(env: dict, cache_dir: str, serve):
    """The RunContext a system's server is built with: the environment's threads and GPU memory, and KV caches
    sized by serve (serve.max_seq_len positions x serve.slots rows); mode=serve and workload=serving both."""
    import torch

    from systems.base import RunContext

    return RunContext(threads=int(env["cpu"]["threads"]), gpu_memory_gb=float(env["gpu"]["memory_gb"]),
                      has_cuda=torch.cuda.is_available(), cache_dir=str(Path(cache_dir).expanduser()),
                      environment=env, max_seq_len=serve.max_seq_len, max_batch=serve.slots)


def server_environment(adapter, serve) -> dict[str, str]:
    """The server's environment: this process's, the system's process_env and server_env(serve), and
    serve.api_key under the variable the system's server reads it from (runners/serving/api_key.py: never on its
    command line). SystemUnavailable where a key is set and the server takes none."""
    env = {**os.environ, **type(adapter).process_env, **adapter.server_env(serve)}
    if serve.api_key:
        if not adapter.server_api_key_env:
            from systems.base import SystemUnavailable

            raise SystemUnavailable(f"system={adapter.config.name}'s server takes no API key (serve.api_key is set)")
        env[adapter.server_api_key_env] = serve.api_key
    return env
