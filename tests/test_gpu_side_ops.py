"""The GPU side's op sequence, checked where no GPU is (issue 51): on the emulated GPU the model runs the ops
CUDA runs, one MoE layer call waits on the device once, and a decode step launches few ops per layer."""
from __future__ import annotations

import functools
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fiddler import Engine
from fiddler.batch import BatchEngine, SamplingParams
from fiddler.executors import FiddlerPolicy, GpuSide
from fiddler.executors.readback import Readback
from fiddler.launches import count_launches
from fiddler.model import fused_rms_norm, rms_norm
from fiddler.step import Segment
from runners.synthetic import default_cache_root, ensure_synthetic_model
from tests.models import ARCHS, MIX_LATENCY, model_path, prompt

PLACEMENTS = {"none": "none", "half": "fraction:0.5", "all": "all"}


@functools.cache
def emulated(placement: str, dtype: torch.dtype = torch.float32, layers: int = 2) -> Engine:
    path = model_path("e8k2") if layers == 2 else ensure_synthetic_model(
        f"test-e8k2-l{layers}", {**ARCHS["e8k2"], "num_hidden_layers": layers}, 0, default_cache_root(),
        dtype="float32", progress=False)
    return Engine.from_pretrained(path, dtype=dtype, max_batch=4, max_seq_len=64,
                                  gpu=GpuSide.emulated(1 << 40),
                                  executor=FiddlerPolicy(placement=PLACEMENTS[placement], latency_model=MIX_LATENCY))


# ---------------------------------------------------------------------------- syncs

# Tensor methods that make the host wait for the device on CUDA (a value read back, or an output sized by
# the data), and the tensor functions that do the same.
SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero",
           "unique", "masked_select", "bincount", "repeat_interleave", "argwhere", "__len__"}


class DeviceTaint(TorchFunctionMode):
    """Follows every tensor computed from a GPU-side tensor (the layer call's inputs) and records each
    syncing call on one. The readback's host copies are not GPU-side (they are what the wait brought back)."""

    def __init__(self):
        super().__init__()
        self._tainted: dict[int, weakref.ref] = {}
        self.syncs: list[str] = []

    def taint(self, *tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._tainted[id(t)] = weakref.ref(t)

    def clean(self, t):
        self._tainted.pop(id(t), None)

    def is_tainted(self, t) -> bool:
        r = self._tainted.get(id(t)) if isinstance(t, torch.Tensor) else None
        return r is not None and r() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = list(args) + list(kwargs.values())
        flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
        tainted = any(self.is_tainted(a) for a in flat)
        name = getattr(func, "__name__", str(func))
        if tainted and (name in SYNCING or (name == "to" and any(_is_cpu(a) for a in flat[1:]))
                        or (name == "__getitem__" and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                                          for a in flat[1:]))):
            self.syncs.append(name)
        out = func(*args, **kwargs)
        if tainted:
            self.taint(*(out if isinstance(out, (list, tuple)) else (out,)))
        return out


def _is_cpu(a) -> bool:
    return (isinstance(a, str) and a.startswith("cpu")) or (isinstance(a, torch.device) and a.type == "cpu")


def trace_layer_calls(e: Engine, run):
    """Runs run() with every MoE layer call traced: [(readback waits, syncing calls)] per call."""
    ex, mode = e.executor, DeviceTaint()
    calls, real_forward, real_to_host = [], ex.forward, Readback._to_host

    def to_host(self, name, t):
        out = real_to_host(self, name, t)
        mode.clean(out)
        return out

    def forward(layer, x, topk_idx, topk_w, residual=None):
        waits0, syncs0 = ex.readback.waits, len(mode.syncs)
        mode.taint(x, topk_idx, topk_w, residual)
        with mode:
            out = real_forward(layer, x, topk_idx, topk_w, residual=residual)
        calls.append((ex.readback.waits - waits0, mode.syncs[syncs0:]))
        return out

    ex.forward = forward
    Readback._to_host = to_host
    try:
        run()
    finally:
        del ex.forward
        Readback._to_host = real_to_host
    return calls


def _steps(e: Engine, how: str):
    V = e.config.vocab_size
    if how == "greedy":
        return lambda: e.generate(prompt(9, V, seed=1), max_new_tokens=5)
    if how == "beams":
        return lambda: e.generate(prompt(7, V, seed=2), max_new_tokens=4, beam_width=3)
    be = BatchEngine(e, token_budget=16)
    return lambda: be.generate([prompt(n, V, seed=n) for n in (3, 12)],
                               [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 2)])


@pytest.mark.parametrize("how", ["greedy", "beams", "batched"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_one_device_wait_per_moe_layer_call(placement, how):
    """Prefill, decode, beams and batched steps at 0 / 50 / 100% resident: each MoE layer call waits on the
    device exactly once (its readback), and no GPU-side tensor is read back any other way."""
    e = emulated(placement)
    calls = trace_layer_calls(e, _steps(e, how))
    assert calls, "no MoE layer call ran"
    assert all(waits == 1 for waits, _ in calls), sorted({w for w, _ in calls})
    assert all(not syncs for _, syncs in calls), [s for _, s in calls if s][:3]


def test_the_trap_catches_a_hidden_sync():
    """The trap itself: a layer call that reads a GPU-side value back (as the bincount + tolist counting did
    before the readback) is caught."""
    e = emulated("all")
    real = e.executor.planner

    def planner_reading_the_device(*a, **k):
        e.executor._probe.sum().item()  # a GPU-side value read on the host
        return real(*a, **k)

    real_begin = e.executor.begin_forward
    e.executor.begin_forward = lambda layer, x, idx: setattr(e.executor, "_probe", x)
    e.executor.planner = planner_reading_the_device
    try:
        calls = trace_layer_calls(e, _steps(e, "greedy"))
    finally:
        e.executor.planner = real
        e.executor.begin_forward = real_begin
        del e.executor._probe
    assert calls and all(syncs == ["item"] for _, syncs in calls)


def test_no_readback_without_a_gpu():
    """Without a GPU the routing is on the host already: no copies, no waits."""
    e = Engine.from_pretrained(model_path("e8k2"), dtype=torch.float32, max_batch=2, max_seq_len=32,
                               gpu=GpuSide.none())
    e.generate(prompt(5, e.config.vocab_size), max_new_tokens=3)
    assert e.executor.readback.waits == 0


# ---------------------------------------------------------------------------- the op sequence

def test_emulated_gpu_runs_the_gpu_op_sequence():
    """No CPU-only fusion on the GPU side: no fused decode, no packed kernel in the dense part or lm_head."""
    e = emulated("all", torch.bfloat16)
    m = e.model
    assert m.decode_path()["path"] == "general"
    assert all(layer.on_gpu for layer in m.layers) and m.gpu_head
    assert all(lin.packed is None for lin in m.linears())
    e.generate(prompt(6, e.config.vocab_size), max_new_tokens=3)
    assert e.model.last_path == "general"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [48, 72, 4096])
def test_fused_rms_norm_has_rms_norms_bits(dtype, width):
    x = (torch.randn(17, width, generator=torch.Generator().manual_seed(width)) * 3).to(dtype)
    w = torch.randn(width, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(fused_rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))


# Launching ops per decoder layer per decode step, every expert resident, top-2, one sequence: the count
# fiddler.launches makes (top-level aten ops less views and metadata), per layer as the difference between the
# same model with 4 and with 2 layers (the embedding, final norm and lm_head are the step's, not a layer's).
# Before issue 51: 68.5 in fp32 (norms as eight ops each, rope per q and k, per-expert index ops, bincount, a
# gather to combine), 29 at its first step. Now, fp32: 2 norms, the qkv GEMM, rope (mul, cat, addcmul written
# back into the projection), one cache write for k and v, attention, o_proj with its residual (addmm), the
# router's GEMM, top-k and softmax, the readback, per expert 2 GEMMs plus one silu and one product for all,
# and the weighted sum with its residual (addmm): 20 at top-2. bf16 adds the norms' weight products (rms_norm's
# two roundings, as transformers).
LAUNCHES_PER_LAYER = {torch.float32: 20, torch.bfloat16: 22}


def _decode_launches(e: Engine) -> tuple[int, dict]:
    e.step(prompt(5, e.config.vocab_size), [Segment(0, 0, 5, True)])
    pos = [5]

    def decode():
        e.step(torch.tensor([7]), [Segment(0, pos[0], 1, True)])
        pos[0] += 1

    return count_launches(decode, steps=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_launches(dtype):
    e2, e4 = emulated("all", dtype), emulated("all", dtype, layers=4)
    (n2, names2), (n4, names4) = _decode_launches(e2), _decode_launches(e4)
    per_layer = (n4 - n2) / 2
    assert per_layer <= LAUNCHES_PER_LAYER[dtype], (per_layer, names4 - names2)
    assert "aten::bincount" not in names4 and "aten::index_select" not in names4  # no per-expert gathers
    for m in (e2.model, e4.model):
        assert m.last_path == "general"
