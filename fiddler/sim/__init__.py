"""The simulator: the engine's own decision code (placement, planner, popularity, latency model) on a
virtual clock costed from a hardware spec, with routing from a popularity profile or a recorded trace.
No weights are touched. See DESIGN.md ("Two modes, one planner") and ARCHITECTURE.md.

    hw = SimHardware.build(spec, Efficiency.for_classes("intel_sapphire_rapids"), measured_limit=False)
    ctx = SimContext(config, torch.bfloat16, hw, gpu_budget_bytes=24 << 30, max_seq_len=544, max_batch=1,
                     popularity=pop)
    policy = FiddlerSimPolicy(planner="makespan"); policy.setup(ctx)
    result = simulate(policy, ctx, ProfileRouting(pop, seed=0), input_len=32, output_len=256)
"""
from .clock import Clock, Lane
from .efficiency import CPU_CLASSES, GPU_CLASSES, CpuClass, Efficiency, GpuClass, cpu_class_of
from .fiddler_policy import FiddlerSimPolicy
from .hardware import SimHardware
from .routing import (CALIBRATION_SOURCE, DEFAULT_RECALL, DEFAULT_REUSE, ProfileRouting, Routing, RoutingStep,
                      TraceRouting, lru_hit_rates, speculative_recall)
from .simulator import ModelCosts, SimContext, SimPolicy, SimResult, Step, simulate
from .trace import RoutingRecorder, RoutingTrace

__all__ = [
    "CALIBRATION_SOURCE", "CPU_CLASSES", "Clock", "CpuClass", "DEFAULT_RECALL", "DEFAULT_REUSE", "Efficiency",
    "FiddlerSimPolicy", "GPU_CLASSES", "GpuClass", "Lane", "ModelCosts", "ProfileRouting", "Routing",
    "RoutingRecorder", "RoutingStep", "RoutingTrace", "SimContext", "SimHardware", "SimPolicy", "SimResult", "Step",
    "TraceRouting", "cpu_class_of", "lru_hit_rates", "simulate", "speculative_recall",
]
