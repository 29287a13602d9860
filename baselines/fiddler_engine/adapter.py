"""`system=fiddler`: the project's own engine (fiddler/) behind the common adapter interface."""
from __future__ import annotations

from typing import Any, Callable

from baselines.base import GenerationRequest, GenerationResult, SystemAdapter


class FiddlerAdapter(SystemAdapter):
    def load(self) -> None:
        import torch

        from fiddler import Engine

        threads = self.options.get("cpu_threads") or self.ctx.threads
        budget_gb = self.options.get("gpu_budget_gb")
        if budget_gb is None:
            budget_gb = self.ctx.gpu_memory_gb
        # no CUDA: there is no GPU budget; every expert runs on the CPU path (the engine's "GPU side"
        # is the CPU device, so orchestration still runs)
        budget = int(budget_gb * 2**30) if self.ctx.has_cuda else None
        self.engine = Engine.from_pretrained(
            self.model.path, dtype=getattr(torch, self.model.dtype), gpu_budget_bytes=budget,
            placement=self.options.get("placement", "popularity"),
            popularity=self.options.get("popularity_profile"), planner=self.options.get("planner", "makespan"),
            cpu_threads=threads, max_seq_len=self.ctx.max_seq_len, max_batch=self.ctx.max_batch,
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
        return self.engine.info()

    def close(self) -> None:
        self.engine = None
