"""`system=mixtral_offloading`: fiddler's engine running the Mixtral-Offloading policy
(baselines/mixtral_offloading/executor.py) behind the common adapter interface."""
from __future__ import annotations

from typing import Any, Callable

from baselines.base import GenerationRequest, GenerationResult, SystemAdapter, SystemUnavailable


def _enum_value(v):
    return getattr(v, "value", v)


class MixtralOffloadingAdapter(SystemAdapter):
    def _budget(self) -> tuple[int | None, str]:
        """GPU budget that sizes the cache when cache_size is null, and where it came from."""
        gb = self.options.get("gpu_budget_gb")
        source = "system.gpu_budget_gb"
        if gb is None:
            gb, source = self.ctx.gpu_memory_gb, "environment.gpu.memory_gb"
        if gb and gb > 0:
            where = "" if self.ctx.has_cuda else ", emulated: the GPU side is the CPU device"
            return int(gb * 2**30), f"{source}={gb:g} GB{where}"
        if self.ctx.has_cuda:  # the engine then takes 90% of the free CUDA memory
            return None, "90% of free CUDA memory (engine default)"
        return None, "none"

    def load(self) -> None:
        import torch

        from .executor import DEFAULT_CACHE_SIZE, load_engine

        quantize = bool(self.options.get("quantize", False))
        if quantize:
            from .quant import require_hqq

            require_hqq()  # SystemUnavailable with the reason when hqq is missing or cannot run here
        threads = self.options.get("cpu_threads") or self.ctx.threads
        budget, source = self._budget()
        self.engine = load_engine(
            self.model.path, dtype=getattr(torch, self.model.dtype), gpu_budget_bytes=budget,
            cache_size=self.options.get("cache_size"), prefetch=bool(self.options.get("prefetch", True)),
            prefetch_k=self.options.get("prefetch_k"),
            prefetch_input=_enum_value(self.options.get("prefetch_input", "residual")), quantize=quantize,
            default_cache_size=int(self.options.get("default_cache_size") or DEFAULT_CACHE_SIZE),
            budget_source=source, cpu_threads=threads, max_seq_len=self.ctx.max_seq_len,
            max_batch=self.ctx.max_batch,
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
        d = self.engine.info()
        d["reimplementation"] = ("Mixtral-Offloading's policy re-implemented in fiddler's engine (the original, "
                                 "dvmazur/mixtral-offloading, is a research repository, not a package)")
        return d

    def close(self) -> None:
        self.engine = None


__all__ = ["MixtralOffloadingAdapter", "SystemUnavailable"]
