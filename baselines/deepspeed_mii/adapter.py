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

Options (``conf/system/deepspeed_mii.yaml``): engine, offload_device (cpu | nvme), pin_memory,
nvme_path, zero_overrides (merged into ``zero_optimization``), tensor_parallel and max_length (mii).
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Callable

from baselines.base import GenerationRequest, GenerationResult, SystemAdapter, SystemUnavailable
from baselines.deepspeed_mii.common import INSTALL_HINT, versions

ENGINES = ("zero_offload", "mii")
DEFAULTS: dict[str, Any] = {
    "engine": "zero_offload",
    "offload_device": "cpu",
    "pin_memory": True,
    "nvme_path": None,
    "zero_overrides": {},
    "tensor_parallel": 1,
    "max_length": None,
}


class DeepSpeedAdapter(SystemAdapter):
    def __init__(self, options, model, ctx):
        super().__init__(options, model, ctx)
        opts = dict(DEFAULTS)
        # structured configs may hand over Enum members; the adapter works with their values
        opts.update({k: (v.value if isinstance(v, Enum) else v) for k, v in dict(options or {}).items() if k in DEFAULTS})
        if opts["engine"] not in ENGINES:
            raise ValueError(f"system.engine must be one of {ENGINES}, got {opts['engine']!r}")
        if opts["offload_device"] not in ("cpu", "nvme"):
            raise ValueError(f"system.offload_device must be cpu or nvme, got {opts['offload_device']!r}")
        self.opts = opts
        self.impl = None

    def load(self) -> None:
        if self.opts["engine"] == "zero_offload":
            from baselines.deepspeed_mii.zero_inference import ZeroInferenceEngine

            self.impl = ZeroInferenceEngine(
                self.model.path, self.model.dtype, threads=self.ctx.threads, has_cuda=self.ctx.has_cuda,
                cache_dir=self.ctx.cache_dir, offload_device=self.opts["offload_device"],
                pin_memory=bool(self.opts["pin_memory"]), nvme_path=self.opts["nvme_path"],
                zero_overrides=dict(self.opts["zero_overrides"] or {}), gpu_memory_gb=self.ctx.gpu_memory_gb,
            )
        else:
            from baselines.deepspeed_mii.fastgen import FastGenEngine

            if self.model.dtype == "float32":
                raise SystemUnavailable("engine=mii: DeepSpeed-MII FastGen runs fp16/bf16 checkpoints only "
                                        "(model.dtype=float32)")
            self.impl = FastGenEngine(self.model.path, has_cuda=self.ctx.has_cuda,
                                      gpu_memory_gb=self.ctx.gpu_memory_gb,
                                      tensor_parallel=int(self.opts["tensor_parallel"]),
                                      max_length=self.opts["max_length"])
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
        out: dict[str, Any] = {"engine": self.opts["engine"], "options": dict(self.opts), "versions": versions(),
                               "install": INSTALL_HINT}
        if self.opts["engine"] == "zero_offload":
            from baselines.deepspeed_mii.zero_inference import ZeroInferenceEngine

            out["recipe"] = ("ZeRO-Inference: HfDeepSpeedConfig + from_pretrained (zero.Init), set_z3_leaf_modules("
                             "MoE block), deepspeed.initialize(ZeRO-3, offload_param), transformers generate "
                             "(greedy/beam, min_new_tokens=max_new_tokens, torch.no_grad)")
            out["first_token"] = "a transformers StoppingCriteria called right after the first new token is chosen"
            out["zero_config"] = (self.impl.ds_config if isinstance(self.impl, ZeroInferenceEngine) else None)
        if self.impl is not None:
            out.update(self.impl.facts)
            if self.opts["engine"] == "zero_offload":
                import torch

                out["torch_threads"] = torch.get_num_threads()
        return out

    def close(self) -> None:
        if self.impl is not None:
            self.impl.close()
            self.impl = None
