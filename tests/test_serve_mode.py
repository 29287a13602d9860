"""`python run.py mode=serve system=S model=M`: the system's server on the model, until SIGTERM (runners/serve.py),
in a subprocess on 127.0.0.1; a system without a server here is `skipped` with its reason; bad serve.* keys
are refused before anything starts. Every server started here is stopped, bounded in time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

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
