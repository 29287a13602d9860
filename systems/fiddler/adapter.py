"""`system=fiddler`: the project's own engine (fiddler/) with Fiddler's executor."""
from __future__ import annotations

from systems.engine_adapter import EngineAdapter

from .config import FiddlerConfig


class FiddlerAdapter(EngineAdapter):
    server_api_key_env = "FIDDLER_API_KEY"  # fiddler.server's (fiddler/server/__main__.py API_KEY_ENV)
    config: FiddlerConfig

    def executor_factory(self):
        from fiddler.executors import FiddlerPolicy

        c = self.config
        if c.original:
            from systems.base import SystemUnavailable

            raise SystemUnavailable("system.original=true models the released Fiddler (efeslab/fiddler@227715b) in "
                                    "mode=simulate only; execute mode runs this project's engine")
        popularity = c.popularity(self.model.name)
        return FiddlerPolicy(placement=c.placement.value, popularity=popularity, planner=c.planner.value,
                             overlap=c.overlap, residency=c.residency.value, lookahead=c.lookahead)

    def server_command(self, serve) -> list[str]:
        """fiddler.server with this system's options: the engine's flags from their one table (fiddler/options.py),
        the sizes from theirs (fiddler/server/__main__.py SIZES)."""
        import sys

        from fiddler.options import command_line
        from fiddler.server.__main__ import size_flags

        c = self.config
        if c.original:
            from systems.base import SystemUnavailable

            raise SystemUnavailable("system=fiddler_original models the released code in mode=simulate; it has no server")
        if c.overlap is not None or c.record_routing or not c.lookahead:
            from systems.base import SystemUnavailable

            raise SystemUnavailable("fiddler.server takes neither system.overlap, system.lookahead=false nor "
                                    "system.record_routing")
        gb, _ = c.gpu_budget(self.ctx.gpu_memory_gb)  # the server reads it with GpuSide.for_budget_gb
        cmd = [sys.executable, "-m", "fiddler.server", "--model", self.model.path, "--served-model-name",
               self.model.name, "--host", serve.host, "--port", str(serve.port),
               "--max-seq-len", str(serve.max_seq_len), "--dtype", self.model.dtype, *size_flags(serve)]
        popularity = c.popularity(self.model.name)
        if popularity is not None and not isinstance(popularity, str):  # the reference (a mean), as a file
            from pathlib import Path

            reference = popularity
            popularity = Path(self.ctx.cache_dir) / "serve" / f"{self.model.name}-reference-popularity.json"
            popularity.parent.mkdir(parents=True, exist_ok=True)
            reference.save(popularity)
        return cmd + command_line(gpu_budget_gb=gb, cpu_threads=c.thread_count(self.ctx.threads),
                                  planner=c.planner.value, placement=c.placement.value,
                                  popularity=str(popularity) if popularity else None, quant=c.quant,
                                  residency=None if c.residency.value == "static" else c.residency.value)

    def server_notes(self) -> dict:
        return {"server": "fiddler.server (fiddler.batch.BatchEngine: continuous batching)"}
