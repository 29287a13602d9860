"""Fiddler's executor plans each MoE layer once per step, whichever path the step takes (issue 46): the fused
decode row, the general path a decode row falls back to when an expert is off the CPU, prefill, beams and
batched steps, with and without the emulated GPU. Before, a decode row that was not all-CPU was planned twice
(once to see it was not, once more on the general path)."""
from __future__ import annotations

import functools

import pytest
import torch

from fiddler import Engine
from fiddler.batch import BatchEngine, SamplingParams
from fiddler.executors import FiddlerPolicy, GpuSide
from tests.models import MIX_LATENCY, model_path, prompt

SETUPS = {
    "cpu": dict(gpu=GpuSide.none()),
    **{f"emulated-{name}-{planner}": dict(gpu=GpuSide.emulated(1 << 40),
                                          executor=FiddlerPolicy(placement=placement, planner=planner,
                                                                 latency_model=MIX_LATENCY))
       for name, placement in (("none", "none"), ("half", "fraction:0.5"), ("all", "all"))
       for planner in ("paper", "makespan")},
}


@functools.cache
def engine(setup: str) -> Engine:
    # bf16: the fused decode row runs only where the CPU kernel serves the experts
    return Engine.from_pretrained(model_path("e8k2"), dtype=torch.bfloat16, max_batch=4, max_seq_len=64,
                                  **SETUPS[setup])


class Counts:
    """Steps (model forwards), MoE layer calls and planner calls, counted on one engine's instances."""

    def __init__(self, e: Engine):
        self.steps = self.moe_calls = self.plans = 0
        ex, model = e.executor, e.model
        self._undo = []
        self._wrap(model, "forward", "steps")
        self._wrap(ex, "forward", "moe_calls")
        self._wrap(ex, "planner", "plans")
        self.layers = e.config.num_moe_layers

    def _wrap(self, obj, attr, counter):
        real = getattr(obj, attr)

        def counted(*a, **k):
            setattr(self, counter, getattr(self, counter) + 1)
            return real(*a, **k)

        setattr(obj, attr, counted)
        self._undo.append((obj, attr, real, attr in vars(obj)))

    def restore(self):
        for obj, attr, real, own in reversed(self._undo):
            if own:
                setattr(obj, attr, real)
            else:
                delattr(obj, attr)


def run(e: Engine, how: str) -> None:
    V = e.config.vocab_size
    if how == "greedy":
        e.generate(prompt(9, V, seed=1), max_new_tokens=6)
    elif how == "beams":
        e.generate(prompt(7, V, seed=2), max_new_tokens=5, beam_width=4)
    else:  # several requests in batched steps: prompt chunks beside decode tokens
        be = BatchEngine(e, token_budget=16)
        be.generate([prompt(n, V, seed=n) for n in (3, 12, 5)],
                    [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 2, 6)])


@pytest.mark.parametrize("how", ["greedy", "beams", "batched"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_one_plan_per_moe_layer_per_step(setup, how):
    e = engine(setup)
    c = Counts(e)
    try:
        run(e, how)
    finally:
        c.restore()
    assert c.steps > 1
    assert c.moe_calls == c.layers * c.steps
    assert c.plans == c.moe_calls, f"{c.plans} plans for {c.moe_calls} MoE layer calls in {c.steps} steps"


def test_the_fused_row_and_its_fallback_both_ran():
    """The setups above reach both decode paths: all-CPU rows on the fused kernel call (no GPU) and rows with
    a resident expert on the general path (half resident), so both are counted by the test above."""
    e = engine("cpu")
    e.generate(prompt(5, e.config.vocab_size, seed=3), max_new_tokens=4)
    kinds = e.executor.stats.experts
    assert kinds["c"] > 0 and kinds["a"] == kinds["b"] == 0
    e = engine("emulated-half-paper")
    calls = []
    real = e.executor._decode_row_on_cpu
    e.executor._decode_row_on_cpu = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        e.generate(prompt(5, e.config.vocab_size, seed=3), max_new_tokens=8)
    finally:
        del e.executor._decode_row_on_cpu
    assert e.executor.stats.experts["a"] > 0  # some decode rows went to the general path
    assert calls  # and some to the fused row


def test_the_batch_engine_uses_only_the_engines_public_names():
    """fiddler/batch drives Engine through its public API (issue 46): no `engine._name` anywhere in it."""
    import ast
    import pathlib

    import fiddler.batch

    private = []
    for path in pathlib.Path(fiddler.batch.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            # self.engine._x, engine._x, e._x where the value names the Engine
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                if name in ("engine", "e", "eng"):
                    private.append(f"{path.name}:{node.lineno} {name}.{node.attr}")
    assert private == []


def test_the_model_has_one_layer_loop_and_one_fused_decode_rule():
    """model.py (issue 46): every forward runs the layers through `_layers`, the only caller of the MoE block;
    whether a step takes the fused decode kernels is `_fused_decode`, asked by forward (and reported by
    decode_path) only."""
    import ast
    import pathlib

    import fiddler.model

    tree = ast.parse(pathlib.Path(fiddler.model.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MoETransformer")

    def callers(name: str) -> list[str]:
        return sorted({f.name for f in cls.body if isinstance(f, ast.FunctionDef) for n in ast.walk(f)
                       if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name})

    assert callers("_moe") == ["_layers"]
    assert callers("_layers") == ["_decode_step", "_forward", "_layer_ops"]
    assert callers("_layer_ops") == ["_decode_step"]
    assert callers("_fused_decode") == ["decode_path", "forward"]
    loops = [f.name for f in cls.body if isinstance(f, ast.FunctionDef) for n in ast.walk(f)
             if isinstance(n, ast.For) and "self.layers" in ast.unparse(n.iter)]
    assert loops == ["_layers"]


def test_the_step_reports_its_path():
    e = engine("cpu")
    out = e.generate(prompt(5, e.config.vocab_size, seed=3), max_new_tokens=4)
    assert out.stats["step_paths"] == {"fused_decode": 3, "graph_decode": 0, "general": 1}
    assert e.info()["decode_path"] == {"path": "fused_decode"}
    e.model.decode_fastpath = False
    try:
        out = e.generate(prompt(5, e.config.vocab_size, seed=3), max_new_tokens=4)
        assert out.stats["step_paths"] == {"fused_decode": 0, "graph_decode": 0, "general": 4}
        assert e.info()["decode_path"] == {"path": "general", "why": "decode_fastpath is off"}
    finally:
        e.model.decode_fastpath = True
