"""Host memory of the engine: one host copy per expert, "device" copies that are separate allocations, the
checkpoint mapping released after load, running short of host memory an error at load (never a silent
fallback), and copies for the copy buffers issued before the resident experts run."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from fiddler import Engine
from fiddler.config import MoEConfig
from fiddler.executors import FiddlerPolicy, GpuSide, build_executor
from fiddler.kernel_loader import load_kernels
from fiddler.latency import LatencyModel
from runners.synthetic import default_cache_root, ensure_synthetic_model
from tests.models import ARCHS
from tests.test_executor import BIG, CFG, LM_EVEN, make_experts, routing

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


# ---------------------------------------------------------------------------- kind b from the packed bytes

ODD = MoEConfig(hidden_size=72, intermediate_size=100, num_layers=2, num_experts=8, top_k=2, num_heads=6,
                num_kv_heads=3, head_dim=12, vocab_size=128)  # rows and columns that pad in both layouts


def _all_copied(quant=None, cfg=CFG):
    """Executors whose every expert is copied in (kind b): from the packed host copy, and from the plain one
    (the kernel off, so host memory holds the weights / block bytes as given)."""
    from fiddler import quant as fquant
    from fiddler.executors import FiddlerExecutor, Threads
    from fiddler.placement import place

    experts = make_experts(cfg, torch.bfloat16)
    if quant is not None:
        experts = [[type(e)(*(fquant.quantize_blocks(t, quant) for t in (e.w1, e.w3, e.w2))) for e in layer]
                   for layer in experts]
    copy_lm = LatencyModel.manual(cpu=(1.0, 10.0), gpu=(1e-6, 1e-5), transfer=1e-4)  # the CPU is hopeless
    gpu = GpuSide.emulated(BIG)
    pl = place(cfg, torch.bfloat16, BIG, max_seq_len=64, max_batch=1, strategy="fraction", fraction=0.0, quant=quant)
    kw = dict(gpu=gpu, dtype=torch.bfloat16, placement=pl, planner="makespan", latency_model=copy_lm,
              threads=Threads.choose(gpu, torch.bfloat16, None, None), quant=quant)
    return experts, FiddlerExecutor(cfg, experts, **kw), FiddlerExecutor(cfg, experts, use_kernel=False, **kw)


@needs_kernel
@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["aligned", "odd"])
@pytest.mark.parametrize("quant", [None, "q4_0", "q8_0"])
def test_kind_b_from_packed_bytes_is_exact(quant, cfg):
    """Kind b copies the packed bytes and unpacks them on the GPU side: bit for bit the weights (bf16) or
    block bytes (Q4_0) given, so its outputs equal those of copying the plain weights in."""
    from fiddler.kernels import layout

    experts, packed, plain = _all_copied(quant, cfg)
    assert packed.packed_host and not plain.packed_host
    for T, seed in ((1, 1), (9, 2), (40, 3)):
        x, idx, w = routing(T, cfg, dtype=torch.bfloat16, seed=seed)
        for layer in range(cfg.num_layers):
            assert torch.equal(packed.forward(layer, x, idx, w), plain.forward(layer, x, idx, w))
    assert packed.stats.tokens == plain.stats.tokens and packed.stats.tokens["c"] == 0
    assert packed.stats.experts["b"] > 0
    H, F = cfg.hidden_size, cfg.intermediate_size
    for layer in range(cfg.num_layers):
        for e, given in enumerate(experts[layer]):
            w13, w2 = packed.packed[layer][e].packed()
            assert all(torch.equal(a, b) for a, b in zip((*layout.unpack(w13, F, H, 2, quant),
                                                          *layout.unpack(w2, H, F, 1, quant)),
                                                         (given.w1, given.w3, given.w2)))


# ---------------------------------------------------------------------------- host_bytes

def test_host_bytes_by_part_and_in_info():
    from fiddler.kernels import layout

    path = bf16_checkpoint()
    cfg = MoEConfig.from_pretrained(path)
    dt = torch.bfloat16
    engine = Engine.from_pretrained(path, gpu=GpuSide.emulated(BIG), dtype=dt, max_seq_len=64, max_batch=1,
                                    executor=FiddlerPolicy(placement="fraction:0.5", latency_model=LM_EVEN))
    engine.generate(torch.arange(3, 12), max_new_tokens=3)
    hb = engine.info()["host_bytes"]
    assert set(hb) == {"dense", "experts", "kv_cache", "buffers"}
    L, E = cfg.num_moe_layers, cfg.expert_slots
    packed = sum(layout.expert_packed_bytes(cfg.hidden_size, cfg.intermediate_size))
    assert hb["experts"] == L * E // 2 * (packed + int(cfg.expert_bytes(dt)))  # each expert once
    assert hb["kv_cache"] == cfg.kv_cache_bytes(64, 1, dt)
    assert hb["buffers"] >= 2 * packed + cfg.expert_bytes(dt)
    assert cfg.non_expert_bytes(dt) <= hb["dense"] <= 2.5 * cfg.non_expert_bytes(dt)
    # without a GPU: nothing resident, no copy buffers
    cpu = Engine.from_pretrained(path, gpu=GpuSide.none(), dtype=dt, max_seq_len=64, max_batch=1)
    hb = cpu.info()["host_bytes"]
    assert hb["experts"] == L * E * packed and hb["buffers"] < 2 * packed


def test_host_memory_error_names_the_numbers(monkeypatch):
    from fiddler import hostmem

    monkeypatch.setattr(hostmem, "available_bytes", lambda: 1000)
    with pytest.raises(hostmem.HostMemoryError, match=r"needs 3000 B .*experts 2000 B.*available 1000 B"):
        hostmem.check_fits("thing", {"experts": 2000, "buffers": 1000})
    hostmem.check_fits("thing", {"experts": 2000}, released=1000)  # fits with what is freed on the way
    monkeypatch.setattr(hostmem, "available_bytes", lambda: None)
    hostmem.check_fits("thing", {"experts": 1 << 60})  # unknown: not judged


def test_cublas_workspace_from_its_config(monkeypatch):
    from fiddler.gpu_side import cublas_workspace_bytes

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert cublas_workspace_bytes(torch.device("cuda")) == 32 << 20
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_bytes(torch.device("cuda")) == (8 << 20) + (128 << 10)
    assert GpuSide.emulated(BIG).overhead_bytes() == {} and GpuSide.none().apply_cap() is None


# ---------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
def test_cuda_host_copies_pinned_at_the_byte_and_asserted(monkeypatch):
    from fiddler import hostmem

    ex = build_executor(CFG, make_experts(dtype=torch.bfloat16), gpu=GpuSide.cuda(BIG), max_seq_len=64,
                        max_batch=1, placement="fraction:0.5", planner="makespan", latency_model=LM_EVEN)
    tensors = [t for h in ex._host_copies() for t in ex._host_tensors(h)]
    assert tensors and all(t.is_pinned() for t in tensors)
    # exactly sized: whole pages, not the caching host allocator's power of two
    assert all(t.untyped_storage().nbytes() < hostmem.nbytes(t) + 3 * hostmem.PAGE for t in tensors)
    monkeypatch.setattr(hostmem, "pinned_copy", lambda t: t.clone())  # pageable: the build must refuse it
    with pytest.raises(RuntimeError, match="not pinned"):
        build_executor(CFG, make_experts(dtype=torch.bfloat16), gpu=GpuSide.cuda(BIG), max_seq_len=64,
                       max_batch=1, placement="fraction:0.5", planner="makespan", latency_model=LM_EVEN)


@pytest.mark.cuda
@cuda
def test_cuda_budget_capped_counted_and_recorded():
    path = bf16_checkpoint()
    torch.cuda.empty_cache()  # what earlier tests cached must not count against this engine's cap
    torch.cuda.reset_peak_memory_stats()
    gpu = GpuSide.cuda(int(1.5 * 2**30))
    try:
        engine = Engine.from_pretrained(path, gpu=gpu, dtype=torch.bfloat16, max_seq_len=64, max_batch=1,
                                        executor=FiddlerPolicy(placement="popularity", latency_model=LM_EVEN))
        cap = engine.info()["cuda_memory_cap"]
        assert cap["cap_bytes"] <= gpu.budget_bytes - cap["cuda_context"] + 1
        assert 0 < cap["load_max_memory_reserved"] <= cap["cap_bytes"]
        reserved = engine.info()["executor_info"]["placement"]["reserved_bytes"]
        assert reserved["cuda_context"] == cap["cuda_context"] and reserved["cublas_workspace"] > 0
        out = engine.generate(torch.arange(3, 12), max_new_tokens=3)
        mem = out.stats["cuda_memory"]
        assert 0 < mem["max_memory_reserved"] <= cap["cap_bytes"] and mem["num_alloc_retries"] >= 0
        with pytest.raises(torch.cuda.OutOfMemoryError):  # the cap holds: no allocation past it
            torch.empty(cap["cap_bytes"] + (1 << 30), dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_short_host_memory_is_an_error_before_loading(monkeypatch):
    """The weights the engine loads into host memory are checked against what is available before the first
    tensor is read (not after a minute of loading, nor by the OOM killer)."""
    from fiddler import hostmem
    from fiddler import weights as fweights

    monkeypatch.setattr(hostmem, "available_bytes", lambda: 1 << 16)
    read = []
    real = fweights.load_weights
    monkeypatch.setattr(fweights, "load_weights", lambda *a, **k: read.append(1) or real(*a, **k))
    import fiddler.engine as fengine

    monkeypatch.setattr(fengine, "load_weights", fweights.load_weights)
    with pytest.raises(MemoryError, match=r"loading.*needs \d+ B.*experts"):
        Engine.from_pretrained(bf16_checkpoint(), gpu=GpuSide.none(), dtype=torch.bfloat16)
    assert read == []


def test_held_bytes_walks_only_its_own_objects():
    """The byte count enters the roots, plain containers, fiddler/systems objects and torch modules; library
    objects, modules and mappings that import on access are leaves (transformers' lazy auto mappings)."""
    import collections
    import types as pytypes

    from fiddler import hostmem
    from fiddler.weights import ExpertWeights

    class Lazy(collections.OrderedDict):
        def values(self):
            raise AssertionError("entered a lazy mapping")

    class Holder:  # a policy's object defined outside fiddler/: entered as a root only
        pass

    t = torch.zeros(1000, dtype=torch.uint8)
    root = Holder()
    root.a = [ExpertWeights(t, t[:10], torch.zeros(24, dtype=torch.uint8))]
    root.lazy, root.module, root.lin = Lazy(x=torch.zeros(5)), pytypes, torch.nn.Linear(4, 2, bias=False)
    root.d = {"k": (torch.zeros(3, dtype=torch.float64),)}
    assert hostmem.held_bytes(root) == 1000 + 24 + 4 * 2 * 4 + 3 * 8  # each storage once
