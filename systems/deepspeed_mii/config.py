"""`system=deepspeed_mii`: the options and their defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional

from systems.base import SystemConfig, check


class DeepSpeedEngine(Enum):
    zero_offload = "zero_offload"  # ZeRO-Inference: ZeRO-3 with parameters offloaded (the paper's baseline)
    mii = "mii"  # DeepSpeed-MII FastGen (CUDA only)


class OffloadDevice(Enum):
    cpu = "cpu"
    nvme = "nvme"


@dataclass
class DeepSpeedConfig(SystemConfig):
    """DeepSpeed baselines (the extra: pip install -e ".[mii]").

    engine=zero_offload: ZeRO-Inference = transformers + ZeRO stage 3 with parameters offloaded to host
    memory; what the Fiddler paper's authors measured as "DeepSpeed-MII". Without CUDA it runs on DeepSpeed's
    CPU accelerator (measured; the record says it is not the paper's setup). engine=mii: DeepSpeed-MII FastGen
    (mii.pipeline); CUDA only, whole model in GPU memory, greedy only (no beam search). Without CUDA: skipped
    with DeepSpeed's own error."""

    label = "DeepSpeed-MII"
    extra = "mii"
    paper_row = 3
    paper_role = "baseline"
    paper_name = "deepspeed_mii"

    name: str = "deepspeed_mii"
    adapter: str = "systems.deepspeed_mii.adapter:DeepSpeedAdapter"
    engine: DeepSpeedEngine = DeepSpeedEngine.zero_offload
    # --- zero_offload
    offload_device: OffloadDevice = OffloadDevice.cpu  # nvme needs DeepSpeed's async_io op (libaio-dev)
    pin_memory: bool = True  # offload_param.pin_memory (a no-op on DeepSpeed's CPU accelerator)
    nvme_path: Optional[str] = None  # offload_device=nvme: swap directory; None = ${cache_dir}/deepspeed_nvme
    # extra zero_optimization keys, e.g. {stage3_param_persistence_threshold: 0}
    zero_overrides: Dict[str, Any] = field(default_factory=dict)
    # --- mii
    tensor_parallel: int = 1  # only 1: the harness runs one process (TP > 1 needs the deepspeed launcher)
    max_length: Optional[int] = None  # FastGen's max prompt+generated length; None = max_position_embeddings

    def __post_init__(self) -> None:
        check(lambda: self.tensor_parallel == 1, "system.tensor_parallel", self.tensor_parallel,
              "1 (the harness runs one process)")
        if self.max_length is not None:
            check(lambda: self.max_length >= 1, "system.max_length", self.max_length, "null or an integer >= 1")

    def sim_policy(self):
        from systems.base import SystemUnavailable

        from .sim import ZeroInferenceSimPolicy

        if self.offload_device is OffloadDevice.nvme:
            raise SystemUnavailable("deepspeed_mii with offload_device=nvme has no simulation model (NVMe "
                                    "bandwidth is not in the environments); simulate offload_device=cpu")
        return ZeroInferenceSimPolicy(resident=self.engine is DeepSpeedEngine.mii)
