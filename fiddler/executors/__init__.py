"""Expert executors: one contract (`ExpertExecutor`) and the pieces policies share.

This package's `__all__` is the public API a new executor policy builds on (with `fiddler.Engine`,
`fiddler.model.DecoderLayer` / `rms_norm` for model hooks and `fiddler.placement.reservation` for sizing):

- contract: ExpertExecutor, StatsBase, BuildContext, ExecutorFactory, add_residual (forward's residual);
- shared pieces: ExpertGroups (group by expert), SlotOutputs (combine), CopyIn (GPU-side copy slots),
  torch_expert (the SwiGLU FFN in torch), expert_counts, kind_counter and the decision kinds;
- executors: LocalExperts (reference), FiddlerExecutor (the paper's orchestration) and their factories.
"""

from ..gpu_side import GpuSide
from ..planner import COPY, CPU, GPU, KINDS
from ..weights import ExpertWeights
from .contract import BuildContext, ExecutorFactory, ExpertExecutor, StatsBase, add_residual
from .copy_in import CopyIn
from .ffn import torch_expert
from .local import LocalExperts, LocalStats, local_executor
from .orchestrator import (FiddlerExecutor, FiddlerPolicy, FiddlerStats, LayerStats, Threads, build_executor,
                           kind_counter)
from .routing import ExpertGroups, SlotOutputs, expert_counts

__all__ = [
    "BuildContext", "COPY", "CPU", "CopyIn", "ExecutorFactory", "ExpertExecutor", "ExpertGroups", "ExpertWeights",
    "FiddlerExecutor", "FiddlerPolicy", "FiddlerStats", "GPU", "GpuSide", "KINDS", "LayerStats", "LocalExperts",
    "LocalStats", "SlotOutputs", "StatsBase", "Threads", "add_residual", "build_executor", "expert_counts",
    "kind_counter", "local_executor", "torch_expert",
]
