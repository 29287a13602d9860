"""`system=fiddler`: the project's own engine (fiddler/) with Fiddler's executor."""
from __future__ import annotations

from systems.engine_adapter import EngineAdapter

from .config import FiddlerConfig


class FiddlerAdapter(EngineAdapter):
    server_api_key_env = "FIDDLER_API_KEY"  # fiddler.server's (fiddler/server/__main__.py API_KEY_ENV)
    config: FiddlerConfig

    def executor_factory(self):
        from fiddler.executors import FiddlerPolicy

        from .profiles import placement_popularity

        c = self.config
        if c.original:
            from systems.base import SystemUnavailable

            raise SystemUnavailable("system.original=true models the released Fiddler (efeslab/fiddler@227715b) in "
                                    "mode=simulate only; execute mode runs this project's engine")
        popularity = placement_popularity(c.popularity_profile, self.model.name)
        return FiddlerPolicy(placement=c.placement.value, popularity=popularity, planner=c.planner.value,
                             overlap=c.overlap)

    def server_command(self, serve) -> list[str]:
        """fiddler.server with this system's options (placement, planner, profile, quant, GPU budget)."""
        import sys

        from .profiles import placement_popularity

        c = self.config
        if c.original:
            from systems.base import SystemUnavailable

            raise SystemUnavailable("system=fiddler_original models the released code in mode=simulate; it has no server")
        if c.overlap is not None or c.record_routing:
            from systems.base import SystemUnavailable

            raise SystemUnavailable("fiddler.server takes neither system.overlap nor system.record_routing")
        gb, _ = c.gpu_budget(self.ctx.gpu_memory_gb)  # the server reads it with GpuSide.for_budget_gb
        cmd = [sys.executable, "-m", "fiddler.server", "--model", self.model.path, "--served-model-name",
               self.model.name, "--host", serve.host, "--port", str(serve.port), "--slots", str(serve.slots),
               "--max-queue", str(serve.max_queue), "--token-budget", str(serve.token_budget),
               "--max-seq-len", str(serve.max_seq_len), "--dtype", self.model.dtype,
               "--drain-timeout", f"{serve.drain_timeout_s:g}", "--gpu-budget-gb", f"{gb:g}",
               "--cpu-threads", str(c.cpu_threads or self.ctx.threads), "--planner", c.planner.value,
               "--placement", c.placement.value]
        popularity = placement_popularity(c.popularity_profile, self.model.name)
        if popularity is not None and not isinstance(popularity, str):  # the reference (a mean), as a file
            from pathlib import Path

            reference = popularity
            popularity = Path(self.ctx.cache_dir) / "serve" / f"{self.model.name}-reference-popularity.json"
            popularity.parent.mkdir(parents=True, exist_ok=True)
            reference.save(popularity)
        if popularity:
            cmd += ["--popularity", str(popularity)]
        if c.quant:
            cmd += ["--quant", c.quant]
        if getattr(serve, "prefix_cache_mb", 0):
            cmd += ["--prefix-cache-mb", f"{serve.prefix_cache_mb:g}"]
        return cmd

    def server_notes(self) -> dict:
        return {"server": "fiddler.server (fiddler.batch.BatchEngine: continuous batching)"}
