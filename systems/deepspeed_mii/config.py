"""Options of `system=deepspeed_mii` (conf/system/deepspeed_mii.yaml)."""
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
    schema_name = "deepspeed_mii_schema"

    engine: DeepSpeedEngine = DeepSpeedEngine.zero_offload
    offload_device: OffloadDevice = OffloadDevice.cpu
    pin_memory: bool = True
    nvme_path: Optional[str] = None
    zero_overrides: Dict[str, Any] = field(default_factory=dict)
    tensor_parallel: int = 1
    max_length: Optional[int] = None

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
