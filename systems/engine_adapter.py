"""The base of every adapter whose system runs inside fiddler's engine with its own executor policy
(system=fiddler, system=mixtral_offloading): GPU side, engine loading, generation and facts."""
from __future__ import annotations

import abc
from typing import Any, Callable

from fiddler.gpu_budget import AUTO
from systems.base import GenerationRequest, GenerationResult, SystemAdapter


class EngineAdapter(SystemAdapter):
    # The engine alternates between its kernel's thread pool and short torch ops; libgomp's default
    # spin-wait after every torch op keeps the cores busy while the kernel needs them (much slower decode
    # and prefill on few cores). transformers alone is faster with the default, so this is per system.
    process_env = {"OMP_WAIT_POLICY": "PASSIVE"}

    @abc.abstractmethod
    def executor_factory(self):
        """The policy: a fiddler.executors.ExecutorFactory built from this system's options."""

    def gpu_side(self):
        """(fiddler.gpu_side.GpuSide, where its budget came from): the budget of systems.base.gpu_budget, as
        the library reads it (GpuSide.for_budget_gb: 0 = no GPU; without CUDA a budget > 0 is emulated, the
        GPU side is the CPU device, so the orchestration runs as it would on a card of that size; auto = 90% of
        the free CUDA memory, no GPU without CUDA)."""
        from fiddler.gpu_side import GpuSide

        gb, key = self.config.gpu_budget(self.ctx.gpu_memory_gb)
        gpu = GpuSide.for_budget_gb(gb)
        if gb == AUTO:
            asked = f"{key}=auto ({gpu.chosen.source})" if gpu.chosen is not None else f"{key}=auto"
        else:
            asked = f"{key}={gb:g}" + (" GB" if gpu.has_gpu else "")
        if not gpu.has_gpu:
            return gpu, f"none ({asked})"
        if gpu.is_cuda:
            return gpu, asked
        return gpu, f"{asked}, emulated: the GPU side is the CPU device"

    @property
    def weight_quant(self) -> str | None:
        """The expert/attention weight type (system.quant where the system has it; fiddler.quant)."""
        return getattr(self.config, "quant", None)

    def load(self) -> None:
        import torch

        from fiddler import Engine

        self.gpu, self.budget_source = self.gpu_side()
        self.engine = Engine.from_pretrained(
            self.model.path, dtype=getattr(torch, self.model.dtype), gpu=self.gpu, executor=self.executor_factory(),
            cpu_threads=self.config.thread_count(self.ctx.threads),
            max_seq_len=self.ctx.max_seq_len, max_batch=self.ctx.max_batch, quant=self.weight_quant,
        )
        self.recorder = None
        if self.config.record_routing:
            from fiddler.sim.trace import RoutingRecorder

            self.recorder = RoutingRecorder.for_config(self.engine.config)
            self.engine.executor.attach_recorder(self.recorder)

    @property
    def routing_trace(self):
        """The routing of the last generate (fiddler.sim.RoutingTrace), when system.record_routing is on."""
        if self.recorder is None or not self.recorder.tokens:
            return None
        lm = getattr(self.engine.executor, "latency_model", None)  # what it decided with (sim.latency_model=trace)
        return self.recorder.trace(model=self.model.name, system=self.config.name, dtype=self.model.dtype,
                                   latency_model={k: v for k, v in lm.to_dict().items() if k != "samples"}
                                   if lm is not None else None)

    def generate(self, request: GenerationRequest, on_first_token: Callable[[], None]) -> GenerationResult:
        if self.recorder is not None:
            self.recorder.reset()  # the trace is of one generate: the last one
        out = self.engine.generate(request.input_ids, max_new_tokens=request.max_new_tokens,
                                   beam_width=request.beam_width, on_first_token=on_first_token)
        stats = {k: v for k, v in out.stats.items() if k != "decode_latencies_s"}
        return GenerationResult(tokens=out.tokens.tolist(), stats=stats)

    def synchronize(self) -> None:
        import torch

        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()

    def info(self) -> dict[str, Any]:
        chosen = self.gpu.chosen  # what the budget became and why (auto: the free memory it was sized from)
        key = self.config.gpu_budget(self.ctx.gpu_memory_gb)[1]
        budget = {**chosen.to_dict(), "key": key} if chosen is not None else None
        return {**self.engine.info(), "gpu_budget_source": self.budget_source, "gpu_budget": budget}

    def close(self) -> None:
        self.engine = None
