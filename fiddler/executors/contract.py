"""The contract between the model/engine and an expert executor.

The model routes each token of a MoE layer to its top-k experts and hands (tokens, ids, weights) to the
executor, which decides where and how the experts run. The engine builds the executor through a factory
(`ExecutorFactory`) from a `BuildContext`, then calls only the methods declared here.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from ..config import MoEConfig
from ..gpu_side import GpuSide
from ..popularity import PopularityRecorder
from ..weights import ExpertWeights


class StatsBase:
    """Base of an executor's counters (a dataclass): `to_dict` gives plain values for records. Properties
    listed in `derived` are added to the dict."""

    derived: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, dict):
                v = dict(v)
            elif isinstance(v, (list, tuple)):
                v = [x.to_dict() if isinstance(x, StatsBase) else x for x in v]
            d[f.name] = v
        for name in self.derived:
            d[name] = getattr(self, name)
        return d


def add_residual(residual: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """forward's result: the experts' sum y, plus the residual where the caller passed one."""
    return y if residual is None else residual + y


class ExpertExecutor(abc.ABC):
    """Runs the experts of one MoE layer call. Implementations set `config`, `dtype` and `stats` in
    `__init__` and call `begin_forward` first in `forward`."""

    config: MoEConfig
    dtype: torch.dtype
    stats: StatsBase
    recorder: PopularityRecorder | None = None
    # True: forward also takes fp32 x (quantized experts on the CPU kernel quantize fp32 activations to Q8_0,
    # as llama.cpp does; the model then hands them the fp32 RMSNorm output); the result stays in `dtype`.
    fp32_inputs: bool = False

    @abc.abstractmethod
    def forward(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """sum_k topk_w[t, k] * expert_{topk_idx[t, k]}(x[t]) for every token t; x [T, H], topk_* [T, K]. With
        `residual` [T, H] (the model's residual stream, as it always passes it): residual + that sum, which a
        policy may add in its own combining op (one launch fewer on a GPU), else by add_residual."""

    @abc.abstractmethod
    def reset_stats(self) -> None:
        """Start the counters in `stats` afresh (the engine calls it at the start of every generate)."""

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """Plain facts for the record: the policy, its options and what it chose at build time."""

    # ------------------------------------------------------------------ hooks the model calls

    def bind_model(self, model) -> None:
        """Called once by the engine with the built fiddler.model.MoETransformer, before the engine
        finalises its linears (drops dense weight copies the CPU kernel no longer needs). A policy may keep
        references to the layers' routers (prefetch) or replace projections (quantization) here."""

    def after_moe(self, layer: int, x: torch.Tensor) -> None:
        """Called by the model with the residual stream right after layer `layer`'s MoE output was added."""

    # ------------------------------------------------------------------ shared behaviour

    def begin_forward(self, layer: int, x: torch.Tensor, topk_idx: torch.Tensor) -> None:
        """What every forward does first: check the activations' dtype, record the routing if asked to."""
        if x.dtype != self.dtype and not (self.fp32_inputs and x.dtype == torch.float32):
            raise TypeError(f"x has dtype {x.dtype} but the executor runs in {self.dtype}")
        if self.recorder is not None:
            self.recorder.record(layer, topk_idx)

    def attach_recorder(self, recorder: PopularityRecorder | None = None) -> PopularityRecorder:
        """Record every layer's routing from now on (scripts/profile_popularity.py)."""
        self.recorder = recorder or PopularityRecorder.for_config(self.config)
        return self.recorder

    def host_bytes(self) -> dict[str, int]:
        """Host memory this executor holds: {"experts": ..., "buffers": ...} (bytes). By default every CPU
        tensor reachable from it counts as experts; a policy with copy buffers splits them out."""
        from ..hostmem import held_bytes

        return {"experts": held_bytes(self), "buffers": 0}

    def close(self) -> None:
        """Release threads or device memory the executor holds."""


@dataclass(frozen=True)
class BuildContext:
    """What the engine knows when it builds the executor."""

    config: MoEConfig
    dtype: torch.dtype
    gpu: GpuSide
    max_seq_len: int  # KV-cache positions (the GPU side reserves room for them)
    max_batch: int
    cpu_threads: int | None = None  # None: every core
    seed: int = 0
    # None, or "q8_0" / "q4_0": the experts handed to the factory hold llama.cpp block bytes (uint8
    # [rows, row bytes], fiddler.quant) instead of dense weights
    quant: str | None = None


class ExecutorFactory(Protocol):
    """Builds an executor from the engine's context and the experts ([layer][expert], host memory). It may
    clear the list's entries as it takes them over, so host memory is freed expert by expert."""

    def __call__(self, ctx: BuildContext, experts: list[list[ExpertWeights | None]]) -> ExpertExecutor: ...
