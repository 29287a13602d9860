"""`system=fiddler`: the project's own engine (fiddler/) behind the common adapter interface."""
from __future__ import annotations

from typing import Any, Callable

from baselines.base import GenerationRequest, GenerationResult, SystemAdapter


class FiddlerAdapter(SystemAdapter):
    """Also the base of adapters of other policies that run inside fiddler's engine."""

    # The engine alternates between its kernel's thread pool and short torch ops; libgomp's default
    # spin-wait after every torch op keeps the cores busy while the kernel needs them (measured on
    # 2 cores, small_mixtral: decode 15 -> 29 tok/s, prefill 300 -> 550 tok/s). transformers alone
    # is faster with the default (decode 15.4-16.7 vs 12.8-13.8 tok/s), so this is per system.
    process_env = {"OMP_WAIT_POLICY": "PASSIVE"}

    def gpu_budget(self) -> tuple[int | None, str]:
        """GPU memory budget in bytes (None = no GPU: every expert on the CPU path) and its source.

        Without CUDA a budget > 0 is emulated: the engine's "GPU side" is then the CPU device, so the
        orchestration (placement, plan, copies) runs as it would on a card of that size.
        """
        gb = self.options.get("gpu_budget_gb")
        source = "system.gpu_budget_gb"
        if gb is None:
            gb, source = self.ctx.gpu_memory_gb, "environment.gpu.memory_gb"
        if gb and gb > 0:
            where = "" if self.ctx.has_cuda else ", emulated: the GPU side is the CPU device"
            return int(gb * 2**30), f"{source}={gb:g} GB{where}"
        if self.ctx.has_cuda:
            return None, "engine default (free CUDA memory)"
        return None, "none (no GPU)"

    def load(self) -> None:
        import torch

        from fiddler import Engine

        budget, self.budget_source = self.gpu_budget()
        self.engine = Engine.from_pretrained(
            self.model.path, dtype=getattr(torch, self.model.dtype), gpu_budget_bytes=budget,
            placement=self.options.get("placement", "popularity"),
            popularity=self.options.get("popularity_profile"), planner=self.options.get("planner", "makespan"),
            cpu_threads=self.options.get("cpu_threads") or self.ctx.threads,
            max_seq_len=self.ctx.max_seq_len, max_batch=self.ctx.max_batch,
        )

    def generate(self, request: GenerationRequest, on_first_token: Callable[[], None]) -> GenerationResult:
        out = self.engine.generate(request.input_ids, max_new_tokens=request.max_new_tokens,
                                   beam_width=request.beam_width, on_first_token=on_first_token)
        stats = {k: v for k, v in out.stats.items() if k != "decode_latencies_s"}
        return GenerationResult(tokens=out.tokens.tolist(), stats=stats)

    def synchronize(self) -> None:
        import torch

        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()

    def info(self) -> dict[str, Any]:
        return {**self.engine.info(), "gpu_budget_source": self.budget_source}

    def close(self) -> None:
        self.engine = None
