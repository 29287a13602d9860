"""Host memory of the engine: one host copy per expert, "device" copies that are separate allocations, the
checkpoint mapping released after load, running short of host memory an error at load (never a silent
fallback), and copies for the copy buffers issued before the resident experts run."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from fiddler import Engine
from fiddler.executors import FiddlerPolicy, GpuSide, build_executor
from fiddler.kernel_loader import load_kernels
from fiddler.latency import LatencyModel
from runners.synthetic import default_cache_root, ensure_synthetic_model
from tests.models import ARCHS
from tests.test_executor import BIG, CFG, LM_CPU, LM_EVEN, make_experts, routing

needs_kernel = pytest.mark.skipif(load_kernels() is None, reason="kernel library not built")


def bf16_checkpoint():
    """A bf16 checkpoint: its tensors load without a dtype conversion (the case that can alias the file)."""
    return ensure_synthetic_model("test-e8k2-bf16", ARCHS["e8k2"], 0, default_cache_root(), dtype="bfloat16",
                                  progress=False)


def storages(obj) -> set[int]:
    """Data pointers of the storages of every tensor held by an expert's holding (ExpertWeights or a packed
    expert)."""
    if obj is None:
        return set()
    return {v.untyped_storage().data_ptr() for v in vars(obj).values() if isinstance(v, torch.Tensor)}


def host_copies(ex, layer: int, e: int) -> list:
    """What the executor keeps of expert (layer, e) in host memory, wherever it keeps it."""
    return [rows[layer][e] for rows in (getattr(ex, "host", None), getattr(ex, "packed", None))
            if rows is not None and rows[layer][e] is not None]


@needs_kernel
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_no_expert_has_two_host_copies(fraction):
    experts = make_experts(dtype=torch.bfloat16)
    inputs = set().union(*(storages(e) for layer in experts for e in layer))
    ex = build_executor(CFG, experts, gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                        placement=f"fraction:{fraction}", planner="makespan", latency_model=LM_EVEN)
    for layer in range(CFG.num_layers):
        for e in range(CFG.expert_slots):
            copies = host_copies(ex, layer, e)
            if ex.placement.resident[layer][e]:
                # resident: only the GPU side's copy, a separate allocation as on CUDA
                assert copies == [], (layer, e)
                assert storages(ex.resident[layer][e]).isdisjoint(inputs), (layer, e)
            else:
                assert len(copies) == 1, (layer, e, copies)


@pytest.mark.parametrize("gpu", [GpuSide.none(), GpuSide.emulated(BIG)], ids=["no-gpu", "emulated"])
def test_checkpoint_mapping_released_after_load(gpu):
    path = bf16_checkpoint()
    engine = Engine.from_pretrained(path, gpu=gpu, dtype=torch.bfloat16,
                                    executor=FiddlerPolicy(placement="fraction:0.5", latency_model=LM_EVEN))
    gc.collect()
    with open("/proc/self/maps") as f:
        mapped = [line.split()[-1] for line in f if str(path) in line]
    assert mapped == []
    del engine


def test_short_host_memory_is_an_error_at_load(monkeypatch):
    psutil = pytest.importorskip("psutil")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=1 << 16, total=1 << 30))
    with pytest.raises(MemoryError, match=r"host memory.*\d+ B"):
        build_executor(CFG, make_experts(dtype=torch.bfloat16), gpu=GpuSide.emulated(BIG), max_seq_len=64,
                       max_batch=1, placement="fraction:0.5", planner="makespan", latency_model=LM_EVEN)


def test_copies_issued_before_resident_experts(monkeypatch):
    import fiddler.executors.orchestrator as orch

    ex = build_executor(CFG, make_experts(), gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                        placement="fraction:0.5", planner="makespan",
                        latency_model=LatencyModel.manual(cpu=(1.0, 10.0), gpu=(1e-6, 1e-5), transfer=1e-4))
    events = []
    real_copy, real_expert = ex.copy_in.copy, orch.torch_expert
    monkeypatch.setattr(ex.copy_in, "copy", lambda slot, *a: events.append(("copy", slot)) or real_copy(slot, *a))
    monkeypatch.setattr(orch, "torch_expert", lambda *a: events.append(("expert",)) or real_expert(*a))
    x, idx, w = routing(64, seed=2)
    ex.forward(0, x, idx, w)
    resident = sum(ex.placement.resident[0][e] and bool((idx == e).any()) for e in range(CFG.expert_slots))
    copied = ex.stats.experts["b"]
    assert resident > 0 and copied >= 2
    assert [k for k, *_ in events[:2]] == ["copy", "copy"]  # both buffers' copies first
    assert events[2:2 + resident] == [("expert",)] * resident
