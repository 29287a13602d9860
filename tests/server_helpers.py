"""Helpers for the server's tests: a `python -m fiddler.server` subprocess on 127.0.0.1 (stopped, bounded in
time, whatever happens), plain HTTP requests, SSE streams and /metrics read back."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

from runners.models import synthetic_model

START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(*extra: str, model=None, command=None):
    """`python -m fiddler.server` with extra options, or command(port) (another server on 127.0.0.1:port)."""
    port = free_port()
    cmd = command(port) if command else [sys.executable, "-m", "fiddler.server", "--model",
                                         str(model or synthetic_model("tiny_mixtral")), "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stdout.read()}")
            try:
                if request(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.2)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def request(port: int, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 120,
            headers: dict | None = None):
    """(status, headers, parsed JSON body or text); `headers` replace the default Content-Type."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if headers is None:
            headers = {"Content-Type": "application/json"} if data else {}
        c.request(method, path, body=data, headers=headers)
        r = c.getresponse()
        text = r.read().decode()
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            payload = text
        return r.status, dict(r.getheaders()), payload
    finally:
        c.close()


def stream(port: int, path: str, body: dict, timeout: float = 120):
    """The SSE events' data fields, parsed ('[DONE]' as is), as they arrive; the connection is yielded first."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    yield c
    for line in r:
        line = line.decode().strip()
        if line.startswith("data: "):
            d = line[6:]
            yield d if d == "[DONE]" else json.loads(d)


def metrics(port: int) -> dict[str, float]:
    status, _, text = request(port, "GET", "/metrics")
    assert status == 200
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def assert_error(resp, status: int, code: str | None = None):
    st, headers, body = resp
    assert st == status, resp
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body


@contextmanager
def inprocess_server(loader, name: str = "tiny"):
    """The app over uvicorn on a thread of this process, for the tests that reach into its state (a tokenizer
    that blocks, the drain's cut, the engine's steps). Yields (ServerState, port); stopped, bounded in time."""
    import threading

    import uvicorn

    from fiddler.server.app import ServerState, create_app
    from fiddler.server.transport import ConnectionLimits, uvicorn_kwargs

    state = ServerState(loader, name)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           **uvicorn_kwargs(ConnectionLimits())))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        end = time.monotonic() + START_TIMEOUT_S
        while not state.ready.is_set():
            if state.load_error or not thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the in-process server did not become ready: {state.load_error}")
            time.sleep(0.1)
        while True:  # listening
            try:
                if request(port, "GET", "/health", timeout=10)[0] == 200:
                    break
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.1)
        yield state, port
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        if state.batch_engine is not None:
            state.batch_engine.stop(drain=False, timeout=STOP_TIMEOUT_S)


def tiny_loader(wrap_tokenizer=None, keep_steps: int = 10_000):
    """A loader of the generated tiny Mixtral for inprocess_server (4 slots, fp32), its tokenizer optionally
    wrapped (a test's hook into tokenization)."""
    def load():
        import torch
        from transformers import AutoTokenizer

        from fiddler import Engine
        from fiddler.batch import BatchEngine

        path = synthetic_model("tiny_mixtral")
        be = BatchEngine(Engine.from_pretrained(path, dtype=torch.float32, max_batch=4, max_seq_len=1024), slots=4,
                         max_queue=8, keep_steps=keep_steps)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return be, (wrap_tokenizer(tok) if wrap_tokenizer else tok)
    return load


class WrappedTokenizer:
    """A tokenizer whose calls go through `hook(text)` first (which may block or raise)."""

    def __init__(self, tok, hook):
        self._tok, self._hook = tok, hook

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, *a, **kw):
        self._hook(text)
        return self._tok(text, *a, **kw)


def kill_all(procs) -> None:
    """SIGKILL each psutil.Process still alive (what a test started and must not leave behind)."""
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
