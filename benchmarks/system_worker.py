"""One system of the regression suite in its own process, as the harness runs it.

Each system gets the environment it declares (`SystemAdapter.process_env`, e.g. the engine's
OMP_WAIT_POLICY=PASSIVE), which OpenMP reads once when torch or llama.cpp loads, so two systems
cannot share a process fairly. The benchmark alternates requests between the workers, so the two
sides of a ratio are still measured interleaved. No heavy import at module level: the worker must
import torch only after its environment is set.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

def _adapter_class(name: str):
    """(adapter class, config class) of `system=<name>`: the config class is the registration
    (systems/registry.py) and names its adapter."""
    from systems.registry import adapter_class, system_class

    config_cls = system_class(name)
    return adapter_class(config_cls.build().adapter), config_cls


def _serve(conn, name: str, model: dict, ctx: dict, options: dict) -> None:
    try:
        from systems.base import GenerationRequest, ModelSpec, RunContext

        adapter_cls, config_cls = _adapter_class(name)
        adapter = adapter_cls(config_cls.build(**options), ModelSpec(**model), RunContext(**ctx))
        adapter.load()
    except Exception as exc:  # reported to the parent (llama.cpp missing: a skipped ratio)
        conn.send(("unavailable", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            adapter.close()
            return
        ids, new = msg
        first = []
        t0 = time.perf_counter()
        adapter.generate(GenerationRequest(input_ids=ids, max_new_tokens=new),
                         lambda: first.append(time.perf_counter()))
        adapter.synchronize()
        end = time.perf_counter()
        conn.send((first[0] - t0, (end - first[0]) / max(1, new - 1)))


class SystemWorker:
    """A loaded system in a child process: `timed(ids, new)` -> (ttft s, decode s per token)."""

    def __init__(self, name: str, model: dict[str, Any], ctx: dict[str, Any], options: dict[str, Any] | None = None):
        """options: the system's config fields (`system.<key>=` on the command line), e.g. quant."""
        from runners.isolation import start_in_env

        adapter_cls, _ = _adapter_class(name)  # light: adapters import their libraries in load()
        spawn = mp.get_context("spawn")
        self.conn, child = spawn.Pipe()
        self.proc = spawn.Process(target=_serve, args=(child, name, model, ctx, dict(options or {})), daemon=True)
        # the system's own environment, and OMP_WAIT_POLICY only where it sets it (as the harness runs it)
        start_in_env(self.proc, adapter_cls.process_env, unset=("OMP_WAIT_POLICY",))
        status, detail = self.conn.recv()
        self.unavailable = detail if status == "unavailable" else None
        self.process_env = dict(adapter_cls.process_env)

    def timed(self, ids: list[int], new: int) -> tuple[float, float]:
        self.conn.send((ids, new))
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive() and self.unavailable is None:
            self.conn.send(None)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
