"""ZeRO-Inference: a transformers model under DeepSpeed ZeRO stage 3 with parameters offloaded.

This is what the Fiddler authors measured as their "DeepSpeed-MII" baseline (their
``benchmarks/eval-baseline.py``): ``HfDeepSpeedConfig`` before ``from_pretrained`` (so the
weights are partitioned while they load), ``deepspeed.utils.set_z3_leaf_modules`` on the Mixtral
MoE block, ``deepspeed.initialize`` with ZeRO stage 3 and ``offload_param`` to the CPU with pinned
memory, then transformers ``generate`` on the wrapped module. Each forward pass gathers every
layer's parameters from host memory (or NVMe) onto the accelerator and releases them afterwards.

Without CUDA, DeepSpeed selects its CPU accelerator (gloo backend, no page-locking: its
``pin_memory`` is a no-op), so "offloaded" parameters and the compute are both in host memory. The
run is real and measured, but it is not the paper's setup; ``info()`` says so.
"""
from __future__ import annotations

import copy
import gc
import os
from typing import Any, Callable

from systems.base import GenerationRequest, GenerationResult, SystemUnavailable, one_line
from systems.deepspeed_mii.common import enforce_gpu_budget, require, single_process_env

OFFLOAD_DEVICES = ("cpu", "nvme")
_DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}


def zero_inference_config(dtype: str, offload_device: str = "cpu", pin_memory: bool = True,
                          nvme_path: str | None = None,
                          overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config of the ZeRO-Inference recipe (stage 3, parameters offloaded)."""
    if offload_device not in OFFLOAD_DEVICES:
        raise ValueError(f"offload_device must be one of {OFFLOAD_DEVICES}, got {offload_device!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    offload: dict[str, Any] = {"device": offload_device, "pin_memory": bool(pin_memory)}
    if offload_device == "nvme":
        if not nvme_path:
            raise ValueError("offload_device=nvme needs nvme_path")
        offload["nvme_path"] = nvme_path
    zero: dict[str, Any] = {"stage": 3, "offload_param": offload}
    for key, value in (overrides or {}).items():
        if key in ("stage", "offload_param"):
            raise ValueError(f"zero_overrides may not change {key!r} (use engine/offload_device/pin_memory)")
        zero[key] = value
    return {
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": 1,  # required by deepspeed.initialize; no training happens
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class ZeroInferenceEngine:
    """Loads and runs the ZeRO-Inference recipe; the adapter delegates to it."""

    def __init__(self, model_path: str, dtype: str, threads: int, has_cuda: bool, cache_dir: str,
                 offload_device: str = "cpu", pin_memory: bool = True, nvme_path: str | None = None,
                 zero_overrides: dict[str, Any] | None = None, gpu_memory_gb: float = 0.0):
        self.gpu_memory_gb = gpu_memory_gb
        self.model_path = model_path
        self.dtype = dtype
        self.threads = threads
        self.has_cuda = has_cuda
        if offload_device == "nvme" and not nvme_path:
            nvme_path = os.path.join(cache_dir, "deepspeed_nvme")
        self.ds_config = zero_inference_config(dtype, offload_device, pin_memory, nvme_path, zero_overrides)
        self.engine = None
        self.module = None
        self.device = None
        self._hf_ds_config = None  # keeps transformers' ZeRO-3 mode on while this model lives
        self.facts: dict[str, Any] = {}

    # ------------------------------------------------------------------ load
    def load(self) -> None:
        import torch

        if not self.has_cuda:
            # Must be set before deepspeed picks its accelerator (it caches the choice).
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        deepspeed = require("deepspeed")
        require("transformers")
        from deepspeed.accelerator import get_accelerator
        from transformers import AutoModelForCausalLM
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        torch.set_num_threads(self.threads)
        accel = get_accelerator()
        accel_name = accel.device_name()
        if self.has_cuda and accel_name != "cuda":
            raise SystemUnavailable(f"CUDA is present but DeepSpeed selected its {accel_name!r} accelerator "
                                    f"(DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')!r})")
        backend = accel.communication_backend_name()
        budget = enforce_gpu_budget(self.gpu_memory_gb) if accel_name == "cuda" else {}

        offload = self.ds_config["zero_optimization"]["offload_param"]
        if offload["device"] == "nvme":
            self._check_async_io()
            os.makedirs(offload["nvme_path"], exist_ok=True)
            # Each swap buffer must hold the largest parameter (DeepSpeed asserts it); the default 1e8
            # elements is smaller than Mixtral-8x7B's fused expert tensors (8 x 2 x 14336 x 4096).
            offload["buffer_size"] = max(int(1e8), self._largest_param_numel())

        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ.update(single_process_env())
            try:
                deepspeed.init_distributed(dist_backend=backend)
            except Exception as exc:
                raise SystemUnavailable(f"ZeRO-Inference: deepspeed.init_distributed(dist_backend={backend!r}) "
                                        f"failed on DeepSpeed's {accel_name} accelerator: {one_line(exc)}") from exc

        # HfDeepSpeedConfig must exist (and stay referenced) before from_pretrained: transformers then
        # builds the model inside deepspeed.zero.Init, so each weight is partitioned as it loads.
        self._hf_ds_config = HfDeepSpeedConfig(copy.deepcopy(self.ds_config))
        try:
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, _DTYPES[self.dtype]))
            leaf_classes = self._set_leaf_modules(deepspeed, model)
            model.eval()
            engine, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(self.ds_config))
        except BaseException:
            self._hf_ds_config = None
            raise
        engine.module.eval()
        self.engine = engine
        self.module = engine.module
        self.device = torch.device(accel.current_device_name())
        torch.set_num_threads(self.threads)  # in case initialisation changed it
        self.facts = {
            "accelerator": accel_name,
            "communication_backend": backend,
            "z3_leaf_modules": leaf_classes,
            "experts_implementation": getattr(self.module.config, "_experts_implementation", None),
            "device": str(self.device),
            "paper_setup": accel_name == "cuda",
            **budget,
        }
        if accel_name == "cpu":
            self.facts["note"] = (
                "ran on DeepSpeed's CPU accelerator (no CUDA here): ZeRO-3 partitions, gathers and releases "
                "parameters every forward pass as on a GPU, but the 'offloaded' parameters and the compute are "
                "both in host memory and pin_memory is a no-op, so this is NOT the paper's GPU setup")

    def _largest_param_numel(self) -> int:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):  # shapes only, no memory
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path))
        return max(p.numel() for p in meta.parameters())

    @staticmethod
    def _set_leaf_modules(deepspeed, model) -> list[str]:
        """Gather each MoE block's parameters as one unit (the authors' recipe; routing is data-dependent)."""
        classes = []
        for module in model.modules():
            if type(module).__name__.endswith("SparseMoeBlock") and type(module) not in classes:
                classes.append(type(module))
        if classes:
            deepspeed.utils.set_z3_leaf_modules(model, classes)
        return [c.__name__ for c in classes]

    def _check_async_io(self) -> None:
        """NVMe offload needs DeepSpeed's async_io op (libaio); report DeepSpeed's own diagnosis."""
        import contextlib
        import io

        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            ok = builder.is_compatible(verbose=True)
        if not ok:
            said = " ".join(line.replace("\x1b[93m", "").replace("\x1b[0m", "").strip()
                            for line in out.getvalue().splitlines() if line.strip())
            raise SystemUnavailable(f"ZeRO-Inference offload_device=nvme needs DeepSpeed's async_io op, which is not "
                                    f"compatible here; DeepSpeed says: {said or builder.error_log}")

    # ------------------------------------------------------------------ generate
    def generate(self, request: GenerationRequest, on_first_token: Callable[[], None]) -> GenerationResult:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        n = request.max_new_tokens
        ids = torch.tensor([request.input_ids], dtype=torch.long, device=self.device)
        prompt_len = ids.shape[1]

        class FirstToken(StoppingCriteria):
            """Never stops; transformers calls it right after each step's token choice (greedy and beam)."""

            def __init__(self):
                self.fired = False

            def __call__(self, input_ids, scores, **kwargs):
                if not self.fired and input_ids.shape[-1] > prompt_len:
                    self.fired = True
                    on_first_token()
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        hook = FirstToken()
        torch.manual_seed(request.seed)
        # no_grad, not inference_mode: ZeRO-3's hooks swap parameter storage during the forward pass
        with torch.no_grad():
            out = self.module.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                min_new_tokens=n,  # EOS can never end a sequence early (same as the hf_transformers reference)
                do_sample=False, num_beams=request.beam_width, early_stopping=False, pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([hook]),
            )
        tokens = out[0, prompt_len:].tolist()
        if len(tokens) != n:
            raise RuntimeError(f"ZeRO-Inference generate returned {len(tokens)} new tokens, expected {n}")
        if not hook.fired:
            on_first_token()  # unreachable for n >= 1; keeps the runner's contract
        return GenerationResult(tokens=tokens, stats={"engine": "zero_offload"})

    def synchronize(self) -> None:
        if self.engine is not None:
            from deepspeed.accelerator import get_accelerator

            get_accelerator().synchronize()

    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.destroy()
            except Exception:
                pass
        self.engine = None
        self.module = None
        self._hf_ds_config = None  # turns transformers' ZeRO-3 loading mode off again
        gc.collect()
        if self.has_cuda:
            import torch

            torch.cuda.empty_cache()
