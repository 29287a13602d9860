"""mode=serve: start the system's OpenAI-compatible server on the model, say where it listens, serve until
SIGTERM (or Ctrl-C), which the server gets to drain. `python run.py mode=serve system=fiddler`.

The server is the system's own (fiddler.server, llama-cpp-python's llama_cpp.server, `transformers serve`),
in a child process with the environment the system declares; the adapter says how to start it
(SystemAdapter.server_command). A system that cannot serve here prints `skipped` with the reason, writes
it to the run folder (serve.json) and exits 0, as a skipped measurement does.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from baselines.base import ModelSpec, RunContext, SystemUnavailable

from .main import prepare, resolve_model_path
from .session import load_adapter_class


def health(host: str, port: int, path: str = "/health", timeout: float = 5.0) -> int | None:
    """The HTTP status of GET path, None when nothing answers."""
    try:
        c = http.client.HTTPConnection(host, port, timeout=timeout)
        c.request("GET", path)
        status = c.getresponse().status
        c.close()
        return status
    except OSError:
        return None


def _context(conf, resolved: dict) -> RunContext:
    import torch

    env = resolved["environment"]
    return RunContext(threads=int(env["cpu"]["threads"]), gpu_memory_gb=float(env["gpu"]["memory_gb"]),
                      has_cuda=torch.cuda.is_available(), cache_dir=str(Path(resolved["cache_dir"]).expanduser()),
                      environment=env, max_seq_len=conf.serve.max_seq_len, max_batch=conf.serve.slots)


def serve(cfg, run_dir: Path) -> int:
    conf, resolved = prepare(cfg)
    s = conf.serve
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    facts: dict[str, Any] = {"system": conf.system.name, "model": conf.model.name, "host": s.host, "port": s.port}

    def write(status: str, **extra) -> None:
        (run_dir / "serve.json").write_text(json.dumps({**facts, "status": status, **extra}, indent=1))

    try:
        model_path = resolve_model_path(conf)
        cls = load_adapter_class(conf.system.adapter)
        adapter = cls(conf.system, ModelSpec(conf.model.name, model_path, conf.model.dtype.value), _context(conf, resolved))
        cmd = adapter.server_command(s)
    except SystemUnavailable as e:
        print(f"skipped: system={conf.system.name} cannot serve here: {e}", file=sys.stderr)
        write("skipped", reason=str(e))
        return 0
    facts.update(model_path=model_path, command=cmd, notes=adapter.server_notes())
    env = {**os.environ, **cls.process_env}
    proc = subprocess.Popen(cmd, env=env)
    stop = {"signal": None}

    def forward(sig, frame):  # the server drains on its own SIGTERM
        stop["signal"] = sig
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM if stop.get("sent") is None else signal.SIGKILL)
            stop["sent"] = sig

    old = {g: signal.signal(g, forward) for g in (signal.SIGTERM, signal.SIGINT)}
    try:
        url = f"http://{s.host}:{s.port}/v1"
        print(f"serving system={conf.system.name} model={conf.model.name} at {url} (loading...)", flush=True)
        end = time.monotonic() + s.ready_timeout_s
        while proc.poll() is None and stop["signal"] is None:
            if health(s.host, s.port, adapter.server_health_path) == 200:
                print(f"ready: {url} (SIGTERM or Ctrl-C stops it)", flush=True)
                write("serving", url=url)
                break
            if time.monotonic() > end:
                print(f"error: the server did not answer {adapter.server_health_path} within "
                      f"serve.ready_timeout_s={s.ready_timeout_s:g}", file=sys.stderr)
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.5)
        rc = proc.wait()
    finally:
        for g, h in old.items():
            signal.signal(g, h)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # a server that ends on the SIGTERM we forwarded by dying of it (uvicorn re-raises it) stopped as asked
    clean = rc == 0 or (stop["signal"] is not None and rc == -signal.SIGTERM)
    write("stopped" if clean else "error", exit_code=rc)
    print(f"server exited with {rc}", file=sys.stdout if clean else sys.stderr)
    return 0 if clean else 1
