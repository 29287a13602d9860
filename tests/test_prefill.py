"""Prefill: who serves the linears at many tokens, and with how many threads (issue 21)."""

from __future__ import annotations

import types

import pytest
import torch

import fiddler.engine as fe
from fiddler import Engine
from fiddler.executors import GpuSide
from tests.models import model_path, prompt


@pytest.fixture(autouse=True)
def _threads_restored():
    """Engines here set 2 threads (cpu_threads=2), process-wide: later tests get the counts back."""
    import fiddler.kernels as fk

    prev_torch, prev_kernel = torch.get_num_threads(), fk.get_num_threads()
    yield
    torch.set_num_threads(prev_torch)
    fk.set_num_threads(prev_kernel)


class ScriptedClock:
    """time.thread_time for choose_kernel_max_tokens: each timed call advances it by its scripted cost."""

    def __init__(self):
        self.now = 0.0

    def thread_time(self):
        return self.now


def test_the_kernel_serves_the_linears_only_up_to_where_it_was_measured_to_win(monkeypatch):
    # A kernel that wins up to 256 tokens and loses at 512 must not serve a 4096-token prefill: the
    # crossover is measured over prefill sizes, not assumed from 256 tokens on.
    clock = ScriptedClock()

    class Packed:
        def __init__(self, w):
            pass

        def forward(self, x, threads=None):
            clock.now += 1.0 if x.shape[0] <= 256 else 3.0

    def linear(x, w):
        clock.now += 2.0

    monkeypatch.setattr(fe, "time", types.SimpleNamespace(thread_time=clock.thread_time))
    monkeypatch.setattr(fe, "load_kernels", lambda: types.SimpleNamespace(PackedLinear=Packed))
    monkeypatch.setattr(fe, "F", types.SimpleNamespace(linear=linear))
    w = torch.zeros(8, 4, dtype=torch.bfloat16)
    assert fe.choose_kernel_max_tokens(w) == 256


def test_torch_gets_every_core_where_it_serves_the_linears(monkeypatch):
    # While the packed kernel serves the linears torch keeps one thread (its pool would spin beside the
    # kernel's); beyond kernel_max_tokens torch serves them and does the prefill's heavy work, so it gets
    # the engine's cores. Seen from inside the executor, which runs on the calling thread.
    monkeypatch.setattr(fe, "choose_kernel_max_tokens", lambda weight: 8)  # the measurement, injected
    e = Engine.from_pretrained(model_path("e8k2"), gpu=GpuSide.none(), cpu_threads=2)  # bf16: kernel linears
    seen = []
    forward = e.executor.forward

    def spy(layer, x, idx, w, **kw):
        seen.append((x.shape[0], torch.get_num_threads()))
        return forward(layer, x, idx, w, **kw)

    e.executor.forward = spy
    e.generate(prompt(16, 512), max_new_tokens=3)
    assert {n for rows, n in seen if rows == 16} == {2}  # prefill: torch serves the linears
    assert {n for rows, n in seen if rows == 1} == {1}  # decode: the kernel does


def test_prefill_logits_agree_whether_torch_or_the_kernel_serves_the_linears(monkeypatch):
    # Which side serves the linears is a speed choice: torch's and the kernel's bf16 linears agree to
    # bf16 rounding of each output.
    ids = prompt(24, 512)
    logits = []
    for max_tokens in (1 << 30, 8):
        monkeypatch.setattr(fe, "choose_kernel_max_tokens", lambda weight, n=max_tokens: n)
        logits.append(Engine.from_pretrained(model_path("e8k2"), gpu=GpuSide.none(), cpu_threads=2)
                      .forward_logits(ids))
    a, b = logits
    assert torch.allclose(a, b, atol=0.05 * float(a.abs().max()), rtol=0)


def test_the_prefill_profiler_leaves_the_engines_thread_switch_as_it_is(monkeypatch):
    # scripts/profile_prefill.py times the projections by wrapping them. It once put a function in each
    # Linear's place; the model then found no packed Linear, kept torch at one thread for the long
    # prefill, and the profile charged the engine's attention and projections twice their real time.
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "profile_prefill.py"
    spec = importlib.util.spec_from_file_location("profile_prefill", script)
    pp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pp)
    monkeypatch.setattr(fe, "choose_kernel_max_tokens", lambda weight: 8)  # the measurement, injected
    e = Engine.from_pretrained(model_path("e8k2"), gpu=GpuSide.none(), cpu_threads=2)
    seen = []
    sdpa = e.model._sdpa
    e.model._sdpa = lambda *a, **kw: (seen.append(torch.get_num_threads()), sdpa(*a, **kw))[1]
    sec = pp.Sections()
    patches = pp.instrument_engine(e, sec)
    e.generate(prompt(16, 512), max_new_tokens=1)
    assert seen and set(seen) == {2}  # 16 tokens > 8: torch serves the linears with the engine's cores
    assert sec.self_s["projections"] > 0 and sec.self_s["router"] > 0
    patches.undo()
    assert all(type(l.o_proj) is type(e.model.layers[0].o_proj) for l in e.model.layers)
    assert type(e.model.layers[0].o_proj).__name__ == "Linear"
