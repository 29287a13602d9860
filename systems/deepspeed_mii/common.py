"""Helpers shared by the two DeepSpeed engines: the extra check, versions, a 1-process group."""
from __future__ import annotations

import os
import socket
from importlib import metadata
from typing import Any

from systems.base import SystemUnavailable

INSTALL_HINT = 'pip install -e ".[mii]"'
# the environment variables torch.distributed's env:// rendezvous reads
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def require(module: str) -> Any:
    """Import ``module`` or raise SystemUnavailable naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SystemUnavailable(
            f"system deepspeed_mii needs the 'mii' extra (deepspeed, deepspeed-mii): {INSTALL_HINT} "
            f"[import {module} failed: {type(exc).__name__}: {exc}]"
        ) from exc


def version_of(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {d: version_of(d) for d in ("deepspeed", "deepspeed-mii", "transformers", "torch")}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def single_process_env() -> dict[str, str]:
    """Environment of a 1-process "distributed" group, for keys a launcher has not set.

    DeepSpeed (ZeRO-3, MII) always runs inside a torch.distributed process group; without a
    launcher (deepspeed / torchrun) we make the group ourselves: rank 0 of world size 1 on a free
    local port. Keys already present (a real launcher) are left alone.
    """
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return {}
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def snapshot_env(keys=DIST_ENV) -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in keys}


def restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def checkpoint_bytes(path: str) -> int:
    """Bytes of the weight files of a Hugging Face checkpoint directory (what must sit in memory)."""
    total = 0
    for name in os.listdir(path):
        if name.endswith((".safetensors", ".bin")):
            total += os.path.getsize(os.path.join(path, name))
    return total


def enforce_gpu_budget(gpu_memory_gb: float) -> dict[str, Any]:
    """Cap this process's CUDA allocations at the environment's GPU memory (an emulated smaller card).

    Returns facts for the record; a no-op without CUDA or when the budget is at least the card.
    """
    import torch

    if not gpu_memory_gb or not torch.cuda.is_available():
        return {}
    total = torch.cuda.get_device_properties(0).total_memory
    budget = gpu_memory_gb * 2**30
    if budget >= total:
        return {"gpu_budget_emulated": False, "gpu_total_gb": round(total / 2**30, 2)}
    torch.cuda.set_per_process_memory_fraction(budget / total, 0)
    return {"gpu_budget_emulated": True, "gpu_budget_gb": gpu_memory_gb, "gpu_total_gb": round(total / 2**30, 2),
            "gpu_budget_method": "torch.cuda.set_per_process_memory_fraction"}
