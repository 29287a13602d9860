"""The decode step whose dense part CUDA graphs capture (fiddler.decode_graph), checked where no GPU is: on
the emulated GPU side the same static ops run eagerly, and must compute the eager decode's function. The
replay itself needs CUDA: scripts/device_check compares it with the eager path on a device."""
from __future__ import annotations

import functools

import pytest
import torch

from fiddler import Engine
from fiddler.batch import BatchEngine, SamplingParams
from fiddler.decode_graph import DecodeGraphs
from fiddler.executors import FiddlerPolicy, GpuSide
from fiddler.step import Segment
from tests.models import MIX_LATENCY, model_path, prompt

PLACEMENTS = {"all": "all", "half": "fraction:0.5", "none": "none"}


@functools.cache
def engine(placement: str, graphs: bool, arch: str = "e8k2") -> Engine:
    return Engine.from_pretrained(model_path(arch), dtype=torch.float32, max_batch=4, max_seq_len=64,
                                  gpu=GpuSide.emulated(1 << 40), decode_graphs=graphs,
                                  executor=FiddlerPolicy(placement=PLACEMENTS[placement], latency_model=MIX_LATENCY))


def _decode_logits(e: Engine, ids: torch.Tensor, steps: int, rows: int = 1) -> list[torch.Tensor]:
    """Prefill ids on rows 0..rows-1, then greedy decode steps: each step's logits [rows, V]."""
    n = ids.shape[0]
    for r in range(rows):
        e.step(ids, [Segment(r, 0, n, True)])
    tok = torch.tensor([int(ids[-1])] * rows)
    out = []
    for t in range(steps):
        logits = e.step(tok, [Segment(r, n + t, 1, True) for r in range(rows)]).clone()
        out.append(logits)
        tok = logits.argmax(-1)
    return out


@pytest.mark.parametrize("arch", ["e8k2", "qwen3_moe"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_static_decode_equals_the_eager_step(placement, arch):
    """fp32 at 0 / 50 / 100% resident (Qwen3: q/k norms): the static step's logits equal the eager GPU side's
    to fp32 rounding (masked keys add exact zeros; the attention's summation order may differ), step after
    step, so the greedy tokens are the same."""
    g, e = engine(placement, True, arch), engine(placement, False, arch)
    ids = prompt(9, g.config.vocab_size, seed=4)
    a, b = _decode_logits(g, ids, 6), _decode_logits(e, ids, 6)
    assert g.model.last_path == "graph_decode" and e.model.last_path == "general"
    for la, lb in zip(a, b):
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    assert [int(x.argmax()) for x in a] == [int(x.argmax()) for x in b]


def test_static_decode_rows_at_once():
    """Three rows (a request's beams) in one step, each equal to the eager step's row."""
    g, e = engine("all", True), engine("all", False)
    ids = prompt(7, g.config.vocab_size, seed=5)
    for la, lb in zip(_decode_logits(g, ids, 4, rows=3), _decode_logits(e, ids, 4, rows=3)):
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)


def test_generate_with_graphs_equals_without():
    """Greedy and beam generation, the engine's own loops."""
    g, e = engine("half", True), engine("half", False)
    ids = prompt(8, g.config.vocab_size, seed=6)
    out = g.generate(ids, max_new_tokens=6)
    assert torch.equal(out.tokens, e.generate(ids, max_new_tokens=6).tokens)
    assert out.stats["step_paths"] == {"fused_decode": 0, "graph_decode": 5, "general": 1}
    assert torch.equal(g.generate(ids, max_new_tokens=4, beam_width=3).tokens,
                       e.generate(ids, max_new_tokens=4, beam_width=3).tokens)
    assert g.model.decode_path() == {"path": "graph_decode", "captured": False}


def test_scattered_rows_take_the_general_path():
    """Continuous batching puts requests on any cache rows: those steps are not the graphs' (rows 0..B-1)."""
    g = engine("all", True)
    assert g.model.decode_graphs.serves([Segment(0, 5, 1), Segment(1, 9, 1)])
    assert not g.model.decode_graphs.serves([Segment(1, 5, 1)])
    assert not g.model.decode_graphs.serves([Segment(0, 5, 2)])
    be = BatchEngine(g, token_budget=16)
    out = be.generate([prompt(n, g.config.vocab_size, seed=n) for n in (3, 6)],
                      [SamplingParams(max_tokens=3, ignore_eos=True) for _ in range(2)])
    ref = BatchEngine(engine("all", False), token_budget=16).generate(
        [prompt(n, g.config.vocab_size, seed=n) for n in (3, 6)],
        [SamplingParams(max_tokens=3, ignore_eos=True) for _ in range(2)])
    assert out == ref


def test_refusals():
    with pytest.raises(ValueError, match="needs a GPU side"):
        Engine.from_pretrained(model_path("e8k2"), dtype=torch.float32, max_batch=2, max_seq_len=32,
                               gpu=GpuSide.none(), decode_graphs=True)
    with pytest.raises(ValueError, match="capture needs CUDA"):
        DecodeGraphs(engine("all", True).model, capture=True)
    with pytest.raises(ValueError, match="GQA"):
        Engine.from_pretrained(model_path("deepseek_v2_lite"), dtype=torch.float32, max_batch=2, max_seq_len=32,
                               gpu=GpuSide.emulated(1 << 40), decode_graphs=True)
