"""`system=deepspeed_mii`: the DeepSpeed baselines behind one adapter.

``engine`` (``system.engine``):

- ``zero_offload`` (default): ZeRO-Inference, i.e. transformers + DeepSpeed ZeRO stage 3 with
  parameters offloaded to host memory (or NVMe). This is what the Fiddler paper's authors ran and
  reported as "DeepSpeed-MII" (their ``benchmarks/eval-baseline.py``; their runs are in
  ``shared/data/reference/fiddler-repo-baseline-runs/ada6000/deepspeed-zero3-offload_*.csv``).
  On CUDA it is the paper's setup; without CUDA it runs on DeepSpeed's CPU accelerator, measured,
  and the record says it is not the paper's setup.
- ``mii``: DeepSpeed-MII FastGen (``mii.pipeline``). CUDA only, and only for models that fit in
  GPU memory (FastGen does not offload). Without CUDA it is tried and the failure DeepSpeed gives
  becomes the ``skipped`` reason.

Options (``systems/deepspeed_mii/config.py``): engine, offload_device (cpu | nvme), pin_memory,
nvme_path, zero_overrides (merged into ``zero_optimization``), tensor_parallel and max_length (mii).
"""
from __future__ import annotations

from typing import Any, Callable

from systems.base import GenerationRequest, GenerationResult, SystemAdapter, SystemUnavailable
from systems.deepspeed_mii.common import INSTALL_HINT, versions
from systems.deepspeed_mii.config import DeepSpeedConfig, DeepSpeedEngine



class DeepSpeedAdapter(SystemAdapter):
    config: DeepSpeedConfig

    def __init__(self, config: DeepSpeedConfig, model, ctx):
        super().__init__(config, model, ctx)
        self.impl = None

    def load(self) -> None:
        c = self.config
        if c.engine is DeepSpeedEngine.zero_offload:
            from systems.deepspeed_mii.zero_inference import ZeroInferenceEngine

            self.impl = ZeroInferenceEngine(
                self.model.path, self.model.dtype, threads=self.ctx.threads, has_cuda=self.ctx.has_cuda,
                cache_dir=self.ctx.cache_dir, offload_device=c.offload_device.value, pin_memory=c.pin_memory,
                nvme_path=c.nvme_path, zero_overrides=dict(c.zero_overrides or {}),
                gpu_memory_gb=self.ctx.gpu_memory_gb,
            )
        else:
            from systems.deepspeed_mii.fastgen import FastGenEngine

            if self.model.dtype == "float32":
                raise SystemUnavailable("engine=mii: DeepSpeed-MII FastGen runs fp16/bf16 checkpoints only "
                                        "(model.dtype=float32)")
            self.impl = FastGenEngine(self.model.path, has_cuda=self.ctx.has_cuda,
                                      gpu_memory_gb=self.ctx.gpu_memory_gb,
                                      tensor_parallel=c.tensor_parallel, max_length=c.max_length)
        try:
            self.impl.load()
        except BaseException:
            self.impl.close()
            self.impl = None
            raise

    def generate(self, request: GenerationRequest, on_first_token: Callable[[], None]) -> GenerationResult:
        if self.impl is None:
            raise RuntimeError("generate() before a successful load()")
        return self.impl.generate(request, on_first_token)

    def synchronize(self) -> None:
        if self.impl is not None:
            self.impl.synchronize()

    def info(self) -> dict[str, Any]:
        zero = self.config.engine is DeepSpeedEngine.zero_offload
        out: dict[str, Any] = {"engine": self.config.engine.value, "options": self.config.to_dict(),
                               "versions": versions(), "install": INSTALL_HINT}
        if zero:
            from systems.deepspeed_mii.zero_inference import ZeroInferenceEngine

            out["recipe"] = ("ZeRO-Inference: HfDeepSpeedConfig + from_pretrained (zero.Init), set_z3_leaf_modules("
                             "MoE block), deepspeed.initialize(ZeRO-3, offload_param), transformers generate "
                             "(greedy/beam, min_new_tokens=max_new_tokens, torch.no_grad)")
            out["first_token"] = "a transformers StoppingCriteria called right after the first new token is chosen"
            out["zero_config"] = (self.impl.ds_config if isinstance(self.impl, ZeroInferenceEngine) else None)
        if self.impl is not None:
            out.update(self.impl.facts)
            if zero:
                import torch

                out["torch_threads"] = torch.get_num_threads()
        return out

    def close(self) -> None:
        if self.impl is not None:
            self.impl.close()
            self.impl = None
