"""`python run.py mode=serve system=S model=M`: the system's server on the model, until SIGTERM (runners/serving/serve.py),
in a subprocess on 127.0.0.1; a system without a server here is `skipped` with its reason; bad serve.* keys
are refused before anything starts. Every server started here is stopped, bounded in time."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.server_helpers import kill_all  # noqa: E402
from tests.test_cli import ROOT, run_py  # noqa: E402
from tests.test_server import free_port, request  # noqa: E402


def test_fiddler_serves_until_sigterm_and_exits_0(tmp_path):
    port, d = free_port(), tmp_path / "D"
    proc = subprocess.Popen([sys.executable, "run.py", "mode=serve", "system=fiddler", "model=tiny_mixtral",
                             f"serve.port={port}", "serve.slots=4", f"hydra.run.dir={d}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out = []
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            out.append(line)
            if line.startswith("ready: "):
                break
            assert time.monotonic() < deadline, "".join(out)
        assert f"http://127.0.0.1:{port}/v1" in "".join(out), "".join(out)
        st, _, body = request(port, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert st == 200 and body["usage"]["completion_tokens"] == 3 and body["model"] == "tiny_mixtral"
        assert json.loads((d / "serve.json").read_text())["status"] == "serving"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    facts = json.loads((d / "serve.json").read_text())
    assert facts["status"] == "stopped" and facts["exit_code"] == 0
    cmd = facts["command"]
    assert cmd[1:3] == ["-m", "fiddler.server"] and cmd[cmd.index("--slots") + 1] == "4"
    assert cmd[cmd.index("--gpu-budget-gb") + 1] == "0"  # environment=local without CUDA: no GPU side


def test_a_system_without_a_server_is_skipped_with_its_reason(tmp_path):
    d = tmp_path / "D"
    res = run_py("mode=serve", "system=mixtral_offloading", "model=tiny_mixtral", f"serve.port={free_port()}",
                 f"hydra.run.dir={d}", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "skipped: system=mixtral_offloading cannot serve here" in res.stderr
    facts = json.loads((d / "serve.json").read_text())
    assert facts["status"] == "skipped" and "no OpenAI-compatible server" in facts["reason"]


@pytest.mark.parametrize("args,message", [
    (("serve.port=0",), "serve.port=0 is invalid"),
    (("serve.slots=16", "serve.token_budget=8"), "serve.token_budget=8 is invalid"),
    (("serve.prot=9000",), "Key 'prot' not in 'ServeConfig'"),  # Hydra's own refusal
])
def test_bad_serve_keys_are_refused_before_anything_starts(tmp_path, args, message):
    res = run_py("mode=serve", "system=fiddler", *args, f"hydra.run.dir={tmp_path / 'D'}", timeout=120)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "D" / "serve.json").exists()


def test_serve_takes_no_sweep(tmp_path):
    res = run_py("-m", "mode=serve", "system=fiddler,llama_cpp", f"hydra.sweep.dir={tmp_path / 'S'}", timeout=120)
    assert res.returncode == 2 and "mode=serve starts one server" in res.stderr, res.stderr[-2000:]


def test_serve_config_composes_with_defaults():
    from hydra import compose, initialize_config_dir

    import runners  # noqa: F401  (the structured configs)
    from runners.main import prepare

    with initialize_config_dir(str(Path(ROOT) / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["mode=serve", "system=fiddler", "serve.port=9123"])
    conf, resolved = prepare(cfg)
    assert conf.serve.port == 9123 and conf.serve.host == "127.0.0.1" and resolved["mode"] == "serve"


# ---------------------------------------------------------------- issue 55 bug 8: the server is ours, and dies with us

def _serve(tmp_path, *args: str) -> tuple[subprocess.Popen, Path]:
    d = tmp_path / "D"
    proc = subprocess.Popen([sys.executable, "run.py", "mode=serve", "system=fiddler", *args, f"hydra.run.dir={d}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, d


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_the_server_dies_with_run_py_even_on_sigkill(tmp_path):
    """SIGKILL of `run.py mode=serve` left the server running under PID 1, still answering, serve.json saying
    `serving`. The child now gets a parent-death signal."""
    import psutil

    port = free_port()
    proc, d = _serve(tmp_path, "model=tiny_mixtral", f"serve.port={port}")
    children = []
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if line.startswith("ready: "):
                break
            assert time.monotonic() < deadline
        children = _descendants(proc.pid)
        assert children and request(port, "GET", "/health")[0] == 200
        proc.kill()
        proc.wait(10)
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.pid for p in alive]
        with pytest.raises(OSError):
            request(port, "GET", "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        kill_all(children)


def test_a_taken_port_is_refused_at_once_never_ready_for_another_server(tmp_path):
    """With serve.port taken, run.py printed `ready:` for the server already there, then its own failed to bind
    and it exited 1. It now refuses before starting one, naming the port, exit 2."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    try:
        proc, d = _serve(tmp_path, "model=tiny_mixtral", f"serve.port={port}")
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                kill_all(_descendants(proc.pid))
                proc.kill()
                proc.wait(10)
    finally:
        other.shutdown()
        other.server_close()
    assert "ready:" not in out, out
    assert proc.returncode == 2 and f"{port}" in err and "already in use" in err, err[-2000:]
    facts = json.loads((d / "serve.json").read_text())
    assert facts["status"] == "error" and "already in use" in facts["reason"]


def test_a_model_that_fails_to_load_is_reported_at_once_with_its_reason(tmp_path):
    """The server's /health said why the model failed to load at once, but run.py waited out
    serve.ready_timeout_s (900 s by default), hid the reason and exited 0 with serve.json `stopped`."""
    from safetensors.torch import load_file, save_file

    from runners.models import synthetic_model

    bad = tmp_path / "m"
    shutil.copytree(synthetic_model("tiny_mixtral"), bad)
    f = next(bad.glob("*.safetensors"))
    tensors = load_file(str(f))
    del tensors["model.norm.weight"]  # the start-up checks read headers only: the server's load finds it missing
    save_file(tensors, str(f), metadata={"format": "pt"})
    proc, d = _serve(tmp_path, f"model.path={bad}", f"serve.port={free_port()}", "serve.ready_timeout_s=150")
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            kill_all(_descendants(proc.pid))
            proc.kill()
            proc.wait(10)
    assert "ready:" not in out
    assert proc.returncode == 1, err[-2000:]
    mine = [line for line in err.splitlines() if line.startswith("error: ")]
    assert mine and "model.norm.weight" in mine[0], err[-2000:]
    assert "ready_timeout_s" not in err  # reported when it happened, not after the wait
    facts = json.loads((d / "serve.json").read_text())
    assert facts["status"] == "error" and "model.norm.weight" in facts["reason"] and facts["exit_code"] != 0
