"""runners/serving/process.py, the one place that starts and stops the run's child processes (servers, the load
generator): they die with the run even on SIGKILL, stopping one stops every process it started, and a server is
ready only when the answer comes from it. Small stand-in children on 127.0.0.1; every one is killed in `finally`."""
from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import psutil
import pytest

from runners.serving import process
from runners.serving.process import PortUnavailable, ServerFailed, ServerProcess
from tests.test_server import free_port

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def _kill(pids) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def test_a_child_and_what_it_started_die_with_the_parent_even_on_sigkill():
    """The child by its parent-death signal (Linux), its worker by the group's guard."""
    worker = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"
    child = [sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}]); "
                                   "time.sleep(600)"]
    parent = subprocess.Popen([sys.executable, "-c", f"import sys, time; from runners.serving.process import start; "
                               f"print(start({child!r}).pid, flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        pids = [int(parent.stdout.readline()), int(parent.stdout.readline())]  # the child's, its worker's
        procs = [psutil.Process(pid) for pid in pids]
        parent.kill()
        parent.wait(10)
        gone, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive
    finally:
        parent.kill()
        parent.wait(10)
        _kill(pids)


def test_stop_ends_the_whole_group_also_what_the_child_left_behind():
    # the child exits at once on SIGTERM; its worker ignores SIGTERM (and says so, its pid, once it does)
    worker_code = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); time.sleep(600)"
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
            f"subprocess.Popen([sys.executable, '-c', {worker_code!r}]); time.sleep(600)")
    proc = process.start([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = psutil.Process(int(proc.stdout.readline()))
        assert process.stop(proc, grace_s=30) == 0
        gone, alive = psutil.wait_procs([worker], timeout=30)
        assert not alive
    finally:
        _kill([proc.pid] + ([worker.pid] if worker else []))


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def _other_server(port: int = 0) -> http.server.HTTPServer:
    other = http.server.HTTPServer(("127.0.0.1", port), _Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    return other


def test_a_port_taken_before_start_is_refused_and_nothing_starts():
    other = _other_server()
    try:
        with pytest.raises(PortUnavailable, match=f"127.0.0.1:{other.server_address[1]} is already in use"):
            ServerProcess(SLEEP, {}, "127.0.0.1", other.server_address[1], "/health")
    finally:
        other.shutdown()
        other.server_close()


def test_an_answer_from_a_process_that_is_not_ours_is_not_ready(tmp_path):
    """The port was free at start, then another process took it while ours loaded: its 200 is not our server's."""
    port = free_port()
    server = ServerProcess(SLEEP, {}, "127.0.0.1", port, "/health", log=tmp_path / "log")
    other = _other_server(port)
    try:
        with pytest.raises(ServerFailed, match="not from the server started here"):
            server.wait_ready(60)
    finally:
        other.shutdown()
        other.server_close()
        server.stop(grace_s=10)


def test_an_early_exit_ends_the_wait_at_once_with_the_servers_last_words(tmp_path):
    code = "import sys; print('loading...'); sys.exit('cannot open the model: no such file')"
    server = ServerProcess([sys.executable, "-c", code], {}, "127.0.0.1", free_port(), "/health")
    try:
        with pytest.raises(ServerFailed, match="exited with 1 before it was ready; its last output: cannot open the model"):
            server.wait_ready(600)
    finally:
        server.stop(grace_s=10)
