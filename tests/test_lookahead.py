"""Look-ahead streaming of experts for long prompts (issue 51, fiddler.streaming): on the emulated GPU a layer call
whose tokens make copying cheaper than the CPU issues the next MoE layer's copies before this layer's experts have
run, and the outputs do not change by a bit."""
from __future__ import annotations

import functools

import pytest
import torch

from fiddler import Engine
from fiddler.config import MoEConfig
from fiddler.executors import FiddlerPolicy, GpuSide
from fiddler.latency import LatencyModel
from fiddler.placement import place
from fiddler.planner import COPY, CPU, GPU, LayerPlan
from fiddler.step import Segment
from fiddler.streaming import lookahead, pipeline
from tests.models import MIX_LATENCY, hf_model, model_path, prompt

PLACEMENTS = {"none": "none", "half": "fraction:0.5", "all": "all"}
# Copying in is cheap and the CPU slow: every non-resident routed expert is copied in (a long prompt's plans), so
# a call with a few tokens an expert stages the next layer's copies. MIX_LATENCY's 40-token plans keep some
# experts on the CPU, and such calls stage nothing.
STREAM_LATENCY = LatencyModel.manual(cpu=(1e-2, 1e-2), gpu=(1e-5, 1e-4), transfer=1e-4)


def _placement(arch: str, spec):
    """A placement spec, or a mask [layer][expert] placed exactly."""
    if isinstance(spec, str):
        return PLACEMENTS.get(spec, spec)
    return place(MoEConfig.from_pretrained(model_path(arch)), torch.float32, 1 << 40, max_seq_len=64, max_batch=2,
                 strategy="mask", mask=spec)


@functools.cache
def engine(placement, lookahead_on: bool = True, arch: str = "e8k2", dtype: torch.dtype = torch.float32,
           residency: str = "static", planner: str = "makespan") -> Engine:
    return Engine.from_pretrained(model_path(arch), dtype=dtype, max_batch=2, max_seq_len=64,
                                  gpu=GpuSide.emulated(1 << 40),
                                  executor=FiddlerPolicy(placement=_placement(arch, placement), residency=residency,
                                                         planner=planner, latency_model=STREAM_LATENCY,
                                                         lookahead=lookahead_on))


def trace(e: Engine, run) -> list[tuple]:
    """The executor's GPU-side events while run() runs, in issue order: ("call", layer) as a MoE layer call
    starts (before its routing is read back), ("copy", layer, expert, buffer) as a weight copy is issued to the
    copy stream, ("run", layer, expert) as a GPU-side expert's compute is issued."""
    ex, events, layer_now = e.executor, [], [None]
    real_forward, real_copy, real_expert = ex.forward, ex._copy_in, ex._gpu_expert

    def forward(layer, *a, **kw):
        layer_now[0] = layer
        events.append(("call", layer))
        return real_forward(layer, *a, **kw)

    def copy_in(layer, e_, slot):
        events.append(("copy", layer, e_, slot))
        return real_copy(layer, e_, slot)

    def gpu_expert(w, groups, e_, *a):
        events.append(("run", layer_now[0], e_))
        return real_expert(w, groups, e_, *a)

    ex.forward, ex._copy_in, ex._gpu_expert = forward, copy_in, gpu_expert
    try:
        run()
    finally:
        del ex.forward, ex._copy_in, ex._gpu_expert
    return events


def calls(events) -> list[list[tuple]]:
    """The events split per MoE layer call."""
    out: list[list[tuple]] = []
    for ev in events:
        if ev[0] == "call":
            out.append([])
        out[-1].append(ev)
    return out


# ---------------------------------------------------------------------------- the rule and the buffers

def test_the_rule_is_the_planners_kind_b_rule_on_an_experts_share():
    """MIX_LATENCY: copy + GPU beats the CPU from 2 tokens an expert on; e8k2 routes 2 of 8, so from 8 tokens. And
    only after a call whose plan runs nothing on the CPU (its results would wait behind the staged copies)."""
    res = [True, False, True, False, False, True, True, True]
    counts = lambda tokens: [tokens * 2 // 8] * 8  # noqa: E731 -- an even routing of `tokens`
    copies = LayerPlan(tuple(GPU if r else COPY for r in res), tuple(counts(8)), 0.0, 0.0)
    mixed = LayerPlan((GPU, CPU, GPU, COPY, COPY, GPU, GPU, GPU), tuple(counts(8)), 0.0, 0.0)
    assert lookahead(counts(8), res, MIX_LATENCY, "makespan", copies) == [1, 3]
    assert lookahead(counts(8), res, MIX_LATENCY, "makespan", mixed) == []
    assert lookahead(counts(7), res, MIX_LATENCY, "makespan", copies) == []  # 1 token an expert: the CPU wins
    assert lookahead(counts(1), res, MIX_LATENCY, "makespan", copies) == []  # decode
    assert lookahead(counts(40), res, None, "makespan", copies) == []  # no latency model, nothing priced
    assert lookahead(counts(40), res, MIX_LATENCY, "cpu", copies) == []  # a planner that never copies in
    assert lookahead(counts(40), [True] * 8, MIX_LATENCY, "paper", copies) == []  # nothing to copy
    slow_copy = LatencyModel.manual(cpu=(1e-4, 1e-3), gpu=(1e-5, 1e-4), transfer=1.0)
    assert lookahead(counts(40), res, slow_copy, "makespan", copies) == []


def test_pipeline_buffers():
    # no copies staged: buffers alternate as the double buffer always did; the next layer's copies go into the
    # buffers in the order their last uses end
    p = pipeline([2, 4, 5], {}, [0, 1])
    assert p.order == (2, 4, 5) and p.slots == (0, 1, 0) and not p.staged
    assert p.ahead == ((0, 1, 1), (1, 0, 2))
    # a layer that copies nothing stages both at the start; one that copies one expert stages into the other
    # buffer at the start and into the first after that expert ran
    assert pipeline([], {}, [3, 6]).ahead == ((3, 0, -1), (6, 1, -1))
    assert pipeline([2], {}, [3, 6]).ahead == ((3, 1, -1), (6, 0, 0))
    # staged copies are used where the plan copies that expert in, in their buffers
    p = pipeline([1, 3, 5, 7], {1: 1, 3: 0}, [])
    assert p.order == (1, 3, 5, 7) and p.slots == (1, 0, 1, 0) and p.staged == {1, 3}
    # one staged and not copied in (the plan runs it on the CPU): its buffer is free for the plan's next copy
    p = pipeline([3, 5, 7], {1: 1, 3: 0}, [2])
    assert p.order == (3, 5, 7) and p.slots == (0, 1, 0) and p.staged == {3} and p.ahead == ((2, 1, 1),)
    # an expert the plan copies in before the staged ones (it left a slot since): the staged ones still run first
    p = pipeline([0, 3], {3: 1}, [])
    assert p.order == (3, 0) and p.slots == (1, 0)


# ---------------------------------------------------------------------------- the copy queue's order

def _prefill(e: Engine, n: int = 40, seed: int = 3):
    return lambda: e.step(prompt(n, e.config.vocab_size, seed=seed), [Segment(0, 0, n, True)])


def test_next_layers_copies_are_queued_before_this_layers_experts_run():
    """Layer 0 fully resident, layer 1 on the host: a 40-token prefill issues layer 1's first two copies at the
    start of layer 0's GPU queue, before any of layer 0's experts runs and before layer 1's routing is known;
    layer 1 runs them from their buffers without copying them again."""
    e = engine(((True,) * 8, (False,) * 8))
    first, second = calls(trace(e, _prefill(e)))
    copies_ahead = [ev for ev in first if ev[0] == "copy"]
    assert [ev[1] for ev in copies_ahead] == [1, 1] and sorted(ev[3] for ev in copies_ahead) == [0, 1]
    runs = [i for i, ev in enumerate(first) if ev[0] == "run"]
    assert runs and all(first.index(ev) < runs[0] for ev in copies_ahead)
    staged = {ev[2] for ev in copies_ahead}
    ran = {ev[2] for ev in second if ev[0] == "run"}
    recopied = {ev[2] for ev in second if ev[0] == "copy"}
    assert staged & ran and not staged & recopied  # used where its plan copies them in, never copied twice
    st = e.executor.stats
    assert st.copies_ahead == 2 and st.copies_ahead_unused == len(staged - ran)


@pytest.mark.parametrize("arch", ["e8k2", "e16k4_odd"])
@pytest.mark.parametrize("placement", ["none", "half"])
def test_copies_ahead_go_out_as_each_buffer_is_last_used(placement, arch):
    """With layer l copying in experts itself, layer l+1's copies go out as soon as layer l is done with a buffer:
    each before layer l's last expert runs or right after it, and all of them before layer l+1's call starts."""
    e = engine(placement, arch=arch)
    per_call = calls(trace(e, _prefill(e)))
    assert len(per_call) == e.config.num_moe_layers
    staged_somewhere = False
    for layer, evs in enumerate(per_call[:-1]):
        ahead = [i for i, ev in enumerate(evs) if ev[0] == "copy" and ev[1] == layer + 1]
        own = [i for i, ev in enumerate(evs) if ev[0] == "copy" and ev[1] == layer]
        runs = [i for i, ev in enumerate(evs) if ev[0] == "run"]
        assert len(ahead) == 2  # 40 tokens: an expert's share makes copying cheaper with STREAM_LATENCY
        staged_somewhere = True
        assert max(own, default=-1) < min(ahead)  # this layer's own copies first on the copy stream
        # the first goes out before this layer's last expert runs, the second at the latest right after it
        assert ahead[0] < runs[-1] and (ahead[1] < runs[-1] or ahead[1] == len(evs) - 1)
    assert staged_somewhere
    last = per_call[-1]
    assert not [ev for ev in last if ev[0] == "copy" and ev[1] != len(per_call) - 1]  # no layer after the last


def test_no_look_ahead_for_decode_or_without_it():
    e = engine("none")
    evs = trace(e, lambda: e.step(torch.tensor([5]), [Segment(0, 40, 1, True)]))
    assert all(ev[1] == call[-1][1] for call in calls(evs) for ev in call if ev[0] == "copy")
    off = engine("none", False)
    for layer_calls in calls(trace(off, _prefill(off))):
        assert all(ev[1] == layer_calls[0][1] for ev in layer_calls if ev[0] == "copy")
    assert off.executor.stats.copies_ahead == 0


# ---------------------------------------------------------------------------- exactness

@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_look_ahead_leaves_prefill_and_greedy_bit_identical(placement):
    """fp32 on the emulated GPU: logits of every prompt position and greedy tokens equal without look-ahead."""
    on, off = engine(placement), engine(placement, False)
    ids = prompt(40, on.config.vocab_size, seed=5)
    assert torch.equal(on.forward_logits(ids), off.forward_logits(ids))
    assert torch.equal(on.generate(ids, max_new_tokens=6).tokens, off.generate(ids, max_new_tokens=6).tokens)
    st = on.executor.stats
    if placement == "all":
        assert st.copies_ahead == 0  # nothing on the host to stream
    else:
        assert st.copies_ahead > 0  # the prefill really staged copies


@pytest.mark.parametrize("residency", ["static", "lfu"])
def test_bf16_packed_copies_and_an_adapting_resident_set(residency):
    """bf16 copies the CPU kernel's packed bytes and unpacks them on the GPU side, and an adaptive resident set
    fills through the last copy buffer, which look-ahead also writes: the same tokens and logits with and
    without look-ahead, over prompts and decode steps that move the resident set. (The planner that copies every
    non-resident expert in: in bf16 the CPU kernel and the GPU side round differently, and a staged expert priced
    as resident may move from the CPU to the GPU side under the other planners, a different result in bf16.)"""
    on, off = engine("half", True, dtype=torch.bfloat16, residency=residency, planner="gpu"), \
        engine("half", False, dtype=torch.bfloat16, residency=residency, planner="gpu")
    for seed in (11, 12, 13):
        ids = prompt(40, on.config.vocab_size, seed=seed)
        a, b = on.generate(ids, max_new_tokens=8), off.generate(ids, max_new_tokens=8)
        assert torch.equal(a.tokens, b.tokens)
        assert on.executor.stats.copies_ahead > 0
    assert torch.equal(on.forward_logits(ids), off.forward_logits(ids))
    assert on.executor.cache.resident == off.executor.cache.resident


def _chunked(e: Engine, ids: torch.Tensor, cuts) -> torch.Tensor:
    start = 0
    for end in cuts:
        logits = e.step(ids[start:end], [Segment(0, start, end - start, end == cuts[-1])])
        start = end
    return logits


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_chunked_streamed_prefill(placement):
    """A prompt prefilled in chunks through the engine's Segment steps, with look-ahead in every chunk: bit-equal
    to the same chunks without look-ahead; equal to the unchunked prefill and to transformers to fp32 rounding
    (chunks attend over the cache with a mask and multiply fewer rows at a time, which rounds differently in
    the last bits with or without look-ahead), with the same next token."""
    on, off = engine(placement), engine(placement, False)
    ids = prompt(40, on.config.vocab_size, seed=7)
    cuts = (16, 28, 40)
    st0 = on.executor.stats.copies_ahead
    chunked = _chunked(on, ids, cuts)
    assert torch.equal(chunked, _chunked(off, ids, cuts))
    assert (on.executor.stats.copies_ahead > st0) == (placement != "all")
    whole = on.step(ids, [Segment(0, 0, 40, True)])
    with torch.no_grad():
        ref = hf_model("e8k2", torch.float32)(ids[None]).logits[0, -1:]
    for other in (whole, ref):
        torch.testing.assert_close(chunked, other, rtol=0, atol=1e-4 * float(other.abs().max()))
        assert torch.equal(chunked.argmax(-1), other.argmax(-1))


# ---------------------------------------------------------------------------- the simulator runs the same pipeline

def _simulated(e: Engine, n: int, new: int, seed: int, lookahead_on: bool = True, residency: str = "static"):
    """The engine's run recorded, and the simulator on that routing with the engine's latency model and placement:
    (the engine's stats, the simulator's stats, the simulator's result)."""
    from fiddler.latency import HardwareSpec
    from fiddler.sim import Efficiency, FiddlerSimPolicy, SimContext, SimHardware, TraceRouting, simulate
    from fiddler.sim.trace import RoutingRecorder

    ex = e.executor
    rec = RoutingRecorder.for_config(e.config)
    ex.attach_recorder(rec)
    try:
        e.generate(prompt(n, e.config.vocab_size, seed=seed), max_new_tokens=new)
    finally:
        ex.recorder = None
    pol = FiddlerSimPolicy(placement=ex.placement, residency=residency, lookahead=lookahead_on)
    pol.latency_model_override = STREAM_LATENCY.to_dict()
    hw = SimHardware.build(HardwareSpec(1000, 100, 10, 100, 8, "avx2", 8), Efficiency.for_classes("amd_zen"),
                           measured_limit=False)
    ctx = SimContext(e.config, torch.float32, hw, 1 << 40, max_seq_len=64, max_batch=2)
    pol.setup(ctx)
    res = simulate(pol, ctx, TraceRouting(rec.trace()), n, new, 1)
    return ex.stats.to_dict(), res.stats, res


@pytest.mark.parametrize("residency", ["static", "lfu"])
@pytest.mark.parametrize("placement", ["none", "half"])
@pytest.mark.parametrize("arch", ["e8k2", "e16k4_odd"])
def test_the_simulator_stages_the_copies_the_executor_stages(arch, placement, residency):
    """On the engine's own routing and latency model: the same copies ahead, the same of them unused, the same
    weight copies and bytes, the same plans (tokens and experts per kind) and resident set moves."""
    e = engine(placement, arch=arch, residency=residency)
    want, got, _ = _simulated(e, 40, 6, seed=21, residency=residency)
    assert want["copies_ahead"] > 0
    for key in ("copies_ahead", "copies_ahead_unused", "weight_copies", "bytes_h2d_weights", "tokens", "experts"):
        assert got[key] == want[key], key
    if residency != "static":
        assert got["residency"] == want["residency"]


def test_look_ahead_on_the_clock():
    """Every non-resident expert copied in (planner gpu; the rule priced by STREAM_LATENCY, under which copying wins):
    look-ahead stages two copies per layer under the previous layer's experts and the attention, wastes none, and
    the prefill ends earlier than without it, with the copy engine busy exactly as long."""
    from fiddler.latency import HardwareSpec
    from fiddler.sim import Efficiency, FiddlerSimPolicy, SimContext, SimHardware, simulate
    from fiddler.popularity import Popularity
    from fiddler.sim.routing import ProfileRouting

    cfg = MoEConfig.from_pretrained(model_path("e16k4_odd"))
    hw = SimHardware.build(HardwareSpec(1000, 100, 10, 100, 8, "avx2", 8), Efficiency.for_classes("amd_zen"),
                           measured_limit=False)
    out = {}
    for on in (True, False):
        pol = FiddlerSimPolicy(planner="gpu", placement="none", lookahead=on)
        pol.latency_model_override = STREAM_LATENCY.to_dict()
        ctx = SimContext(cfg, torch.float32, hw, 1 << 40, max_seq_len=256, max_batch=1)
        pol.setup(ctx)
        routing = ProfileRouting(Popularity.for_config(cfg, None), seed=0)
        out[on] = simulate(pol, ctx, routing, 200, 1, 1)
    on, off = out[True], out[False]
    assert on.stats["copies_ahead"] == 2 * (cfg.num_moe_layers - 1) and on.stats["copies_ahead_unused"] == 0
    assert on.stats["weight_copies"] == off.stats["weight_copies"] == cfg.num_moe_layers * cfg.expert_slots
    assert on.lanes_busy_s["h2d"] == pytest.approx(off.lanes_busy_s["h2d"])
    assert on.ttft_s < off.ttft_s


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("placement", ["none", "fraction:0.5"])
def test_cuda_staged_copies_through_the_copy_stream(placement, dtype):
    """On CUDA the staged copies go on the copy stream, after the events of their buffers' last reads, and the
    next layer's compute waits for them by event, with no host wait in between: the same logits and tokens as
    without look-ahead (the same plans: STREAM_LATENCY copies every non-resident expert in), in chunks too."""
    def build(on: bool) -> Engine:
        return Engine.from_pretrained(model_path("e16k4_odd"), dtype=dtype, max_batch=1, max_seq_len=64,
                                      gpu=GpuSide.cuda(256 << 20),
                                      executor=FiddlerPolicy(placement=placement, latency_model=STREAM_LATENCY,
                                                             lookahead=on))

    on, off = build(True), build(False)
    ids = prompt(40, on.config.vocab_size, seed=31)
    assert torch.equal(on.forward_logits(ids), off.forward_logits(ids))
    assert torch.equal(on.generate(ids, max_new_tokens=6).tokens, off.generate(ids, max_new_tokens=6).tokens)
    assert torch.equal(_chunked(on, ids, (16, 28, 40)), _chunked(off, ids, (16, 28, 40)))
    assert on.executor.stats.copies_ahead > 0 and off.executor.stats.copies_ahead == 0
