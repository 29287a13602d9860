"""mode=serve: start the system's OpenAI-compatible server on the model, say where it listens, serve until
SIGTERM (or Ctrl-C), which the server gets to drain. `python run.py mode=serve system=fiddler`.

The server is the system's own (fiddler.server, llama-cpp-python's llama_cpp.server, `transformers serve`),
in a child process with the environment the system declares; the adapter says how to start it
(SystemAdapter.server_command). A system that cannot serve here prints `skipped` with the reason, writes
it to the run folder (serve.json) and exits 0, as a skipped measurement does.

The child is started and stopped by runners/serving/process.py: it never outlives this process (even
SIGKILLed), `ready:` means the server started here answered, and a failed start (a taken port: exit 2, as a
bad key; an early exit or a load failure /health reports: exit 1) is said at once, with the reason, in the
output and in serve.json.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

from systems.base import ModelSpec, SystemUnavailable

from ..main import prepare, resolve_model_path
from ..schema import ConfigError
from .process import PortUnavailable, ServerFailed, ServerProcess, server_context, server_environment
from ..session import load_adapter_class


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
        adapter = cls(conf.system, ModelSpec(conf.model.name, model_path, conf.model.dtype.value),
                      server_context(resolved["environment"], resolved["cache_dir"], s))
        cmd = adapter.server_command(s)
        env = server_environment(adapter, s)
    except SystemUnavailable as e:
        print(f"skipped: system={conf.system.name} cannot serve here: {e}", file=sys.stderr)
        write("skipped", reason=str(e))
        return 0
    facts.update(model_path=model_path, command=cmd, notes=adapter.server_notes())
    try:
        server = ServerProcess(cmd, env, s.host, s.port, adapter.server_health_path)
    except PortUnavailable as e:  # nothing started: like a bad key, exit 2 (run.py), naming the way out
        reason = f"serve.host={s.host} serve.port={s.port}: {e}"
        write("error", reason=reason)
        raise ConfigError(reason) from None
    facts["pid"] = server.proc.pid
    stop: dict[str, Any] = {"signal": None}

    def forward(sig, frame):  # the server drains on its own SIGTERM; a second signal kills it
        server.signal(signal.SIGTERM if stop["signal"] is None else signal.SIGKILL)
        stop["signal"] = sig

    old = {g: signal.signal(g, forward) for g in (signal.SIGTERM, signal.SIGINT)}
    failure = None
    try:
        url = f"http://{s.host}:{s.port}/v1"
        print(f"serving system={conf.system.name} model={conf.model.name} at {url} (loading...)", flush=True)
        try:
            if server.wait_ready(s.ready_timeout_s, cancelled=lambda: stop["signal"] is not None):
                print(f"ready: {url} (SIGTERM or Ctrl-C stops it)", flush=True)
                write("serving", url=url)
        except ServerFailed as e:
            failure = str(e)
            print(f"error: {failure}", file=sys.stderr, flush=True)
            server.signal(signal.SIGTERM)
        server.proc.wait()  # until the server ends: on a forwarded signal, or of itself
    finally:
        for g, h in old.items():
            signal.signal(g, h)
        rc = server.stop(s.drain_timeout_s + 30)  # what is left of its process group
    # a server that ends on the SIGTERM we forwarded by dying of it (uvicorn re-raises it) stopped as asked
    clean = failure is None and (rc == 0 or (stop["signal"] is not None and rc == -signal.SIGTERM))
    # exit_code: this run's; a server stopped after a failed start may itself exit 0
    if clean:
        write("stopped", exit_code=0, server_exit_code=rc)
    else:
        write("error", exit_code=1, server_exit_code=rc, reason=failure or f"the server exited with {rc}")
    print(f"server exited with {rc}" + (" (stopped after the error above)" if failure else ""),
          file=sys.stdout if clean else sys.stderr)
    return 0 if clean else 1
