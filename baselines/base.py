"""The one interface every benchmarked system implements.

The runner (``runners/``) owns timing: it starts a clock, calls ``generate`` and stops the clock.
The system calls ``on_first_token()`` exactly once, right after the first new token exists (after
the prefill forward and the first token choice), so that TTFT and decode time are measured by the
same code for every system. Systems never time themselves for the headline metrics.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable


class SystemUnavailable(RuntimeError):
    """The system cannot run on this machine (missing extra, no CUDA, ...).

    The runner turns it into a record with status ``skipped`` and ``str(exc)`` as the reason.
    """


@dataclass
class ModelSpec:
    """The checkpoint every system loads (a Hugging Face Mixtral-architecture directory)."""

    name: str
    path: str  # local directory with config.json, *.safetensors and tokenizer.model
    dtype: str = "bfloat16"  # "bfloat16" | "float32"


@dataclass
class RunContext:
    """Machine facts a system needs: thread count, GPU budget, work directory for caches."""

    threads: int
    gpu_memory_gb: float
    has_cuda: bool
    cache_dir: str
    environment: dict[str, Any] = field(default_factory=dict)  # resolved environment config
    # the largest request of the job (prompt + new tokens, beams), so systems can size KV caches
    max_seq_len: int = 4096
    max_batch: int = 1


@dataclass
class GenerationRequest:
    input_ids: list[int]
    max_new_tokens: int  # generate exactly this many (end-of-sequence ignored)
    beam_width: int = 1  # 1 = greedy
    seed: int = 0


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens of the returned (best) sequence, len == max_new_tokens
    stats: dict[str, Any] = field(default_factory=dict)  # system-specific (hit rate, decisions, ...)


class SystemAdapter(abc.ABC):
    """Base class of every system adapter. Subclasses import heavy dependencies lazily in ``load``."""

    #: token accounting used for beams: tokens counted are those of the returned sequence (paper)
    token_accounting = "returned_sequence"
    #: environment variables the system needs set before torch (or its own runtime) is imported,
    #: e.g. OpenMP settings read once at library load; the runner then runs it in a fresh process
    process_env: dict[str, str] = {}

    def __init__(self, options: dict[str, Any], model: ModelSpec, ctx: RunContext):
        self.options = options
        self.model = model
        self.ctx = ctx

    @abc.abstractmethod
    def load(self) -> None:
        """Load weights etc. Not timed. Raise SystemUnavailable if the system cannot run here."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest, on_first_token: Callable[[], None]) -> GenerationResult:
        """Generate ``request.max_new_tokens`` tokens; call ``on_first_token()`` once."""

    def synchronize(self) -> None:
        """Wait for outstanding device work (the runner calls it around timed regions)."""

    def info(self) -> dict[str, Any]:
        """Facts for the record: library versions, implementation choices, thread counts."""
        return {}

    def close(self) -> None:
        """Release memory (called once after the last configuration of this system)."""
