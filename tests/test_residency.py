"""The resident set that adapts (fiddler.residency): the policies' rules, the fill mechanism's arithmetic with
injected latency models, the executor's fills (exact, slots holding the right bytes), the engine against
transformers with every policy, the budget's fill buffer, and the harness key."""
from __future__ import annotations

import pytest
import torch

from fiddler.executors import GpuSide, build_executor
from fiddler.latency import LatencyModel
from fiddler.weights import ExpertWeights
from fiddler.planner import COPY, CPU, GPU, LayerPlan
from fiddler.residency import (Chunk, DecayedLFUPolicy, ExpertCache, Install, LRUPolicy, Promote,
                               ResidencyPolicy, make_policy)
from tests.test_executor import BIG, CFG, make_experts, reference, routing

HOST = 1000  # bytes of one host copy in the mechanism tests
MIX = LatencyModel.manual(cpu=(1e-4, 1e-3), gpu=(1e-5, 1e-4), transfer=1e-3)  # decode rows run on the CPU
LM = LatencyModel.manual(cpu=(1e-3, 0.0), gpu=(1e-4, 0.0), transfer=4e-3)  # a copy takes 4 CPU experts' time


def plan(counts, decisions, lm=LM) -> LayerPlan:
    from fiddler.planner import predict

    c, g = predict(counts, decisions, lm)
    return LayerPlan(tuple(decisions), tuple(counts), c, g)


def two_layers(resident0, resident1, shares=None):
    res = [list(resident0), list(resident1)]
    return res, shares or [[0.5] * len(resident0) for _ in res]


# ----------------------------------------------------------------------------------------- policies

def test_static_never_fills_and_counts_nothing():
    res, sh = two_layers([True, False, False, False], [True, False, False, False])
    cache = ExpertCache(res, ResidencyPolicy(res, sh), HOST)
    for _ in range(10):
        assert cache.step(0, [0, 3, 0, 0], plan([0, 3, 0, 0], [None, CPU, None, None]), LM) == []
    assert cache.resident == res and cache.stats.fills_started == 0 and cache.describe() == {"policy": "static"}


def test_lfu_across_layers_learns_a_shift_and_evicts_the_coldest_slot_of_any_layer():
    # layer 0 holds expert 0, layer 1 holds expert 0; the routing adds expert 2 of layer 0, and layer 1's
    # expert 0 is never routed: its slot is the coldest
    res, _ = two_layers([True, False, False, False], [True, False, False, False])
    pol = DecayedLFUPolicy(res, [[1.0, 0.4, 0.3, 0.3]] * 2, half_life=4, margin=1.1, prior_calls=2, per_layer=False)
    cache = ExpertCache(res, pol, HOST)
    actions = []
    for _ in range(6):
        counts = [1, 0, 1, 0]
        actions += cache.step(0, counts, plan(counts, [GPU, None, CPU, None]), None)
        cache.step(1, [0, 1, 0, 0], plan([0, 1, 0, 0], [None, CPU, None, None]), None)
    installs = [a for a in actions if isinstance(a, Install)]
    assert installs and installs[0].layer == 0 and installs[0].expert == 2
    assert (installs[0].victim_layer, installs[0].victim) == (1, 0)  # the other layer's cold slot
    assert cache.resident[0][2] and not cache.resident[1][0]
    assert sum(map(sum, cache.resident)) == 2  # a fill moves a slot, never adds one
    assert cache.stats.fills == cache.stats.to_dict()["evictions"] >= 1


def test_lfu_evicts_within_the_layer_by_default():
    res, _ = two_layers([True, True, False, False], [True, False, False, False])
    cache = ExpertCache(res, DecayedLFUPolicy(res, [[1.0, 0.4, 0.3, 0.3]] * 2, half_life=4, prior_calls=2), HOST)
    installs = []
    for _ in range(8):
        counts = [1, 0, 1, 0]
        installs += [a for a in cache.step(0, counts, plan(counts, [GPU, None, CPU, None]), None)
                     if isinstance(a, Install)]
        installs += [a for a in cache.step(1, [0, 1, 0, 0], plan([0, 1, 0, 0], [None, CPU, None, None]), None)
                     if isinstance(a, Install)]
    assert Install(0, 2, 0, 1) in installs and Install(1, 1, 1, 0) in installs
    assert all(a.layer == a.victim_layer for a in installs)
    assert cache.resident == [[True, False, True, False], [False, True, False, False]]


def test_a_copied_in_expert_is_kept_while_the_gpu_has_the_time():
    res, _ = two_layers([True, False, False, False], [True, False, False, False])
    cache = ExpertCache(res, DecayedLFUPolicy(res, [[0.1, 5.0, 0.1, 0.1]] * 2, half_life=8), HOST)
    counts = [0, 20, 0, 0]
    busy = plan(counts, [None, COPY, None, None])  # the GPU queue is the makespan: no time to keep it
    assert [a for a in cache.step(0, counts, busy, LM) if isinstance(a, Promote)] == []
    counts = [0, 1, 20, 0]  # the CPU queue is long: the GPU has time for an unpack
    actions = cache.step(0, counts, plan(counts, [None, COPY, CPU, None]), LM)
    assert actions == [Promote(0, 1, 0, 0)] and cache.resident[0] == [False, True, False, False]
    assert cache.stats.promoted == 1 and cache.stats.to_dict()["evictions"] == 1


def test_lfu_does_not_swap_near_ties():
    res, _ = two_layers([True, False], [True, False])
    pol = DecayedLFUPolicy(res, [[0.5, 0.5], [0.5, 0.5]], half_life=8, margin=1.5, prior_calls=4)
    cache = ExpertCache(res, pol, HOST)
    for i in range(40):  # both experts routed alike: never worth a copy
        counts = [1, 1]
        cache.step(i % 2, counts, plan(counts, [GPU, CPU]), LM)
    assert cache.stats.fills_started == 0 and cache.resident == [[True, False], [True, False]]


def test_lru_admits_a_repeated_miss_and_evicts_its_layers_least_recent():
    res, _ = two_layers([True, True, False, False], [True, False, False, False])
    pol = LRUPolicy(res, [[0.6, 0.5, 0.2, 0.2], [0.5, 0.2, 0.2, 0.2]], admission_half_life=2)
    assert list(pol.lru[0]) == [1, 0]  # least popular resident is the least recently used at the start
    cache = ExpertCache(res, pol, HOST)
    counts = [1, 0, 0, 0]
    cache.step(0, counts, plan(counts, [GPU, None, None, None]), None)  # expert 0 used: expert 1 is the LRU
    installs = []
    for _ in range(4):  # expert 3 keeps missing: its admission count passes expert 1's
        counts = [0, 0, 0, 2]
        installs += [a for a in cache.step(0, counts, plan(counts, [None, None, None, CPU]), None)
                     if isinstance(a, Install)]
    assert installs[0] == Install(0, 3, 0, 1)
    assert cache.resident[0] == [True, False, False, True] and cache.resident[1] == [True, False, False, False]
    assert list(pol.lru[0])[-1] == 3


def test_lru_refuses_a_one_off_miss():
    res, _ = two_layers([True, False, False, False], [True, False, False, False])
    pol = LRUPolicy(res, [[1.0, 0.4, 0.3, 0.3]] * 2)
    cache = ExpertCache(res, pol, HOST)
    counts = [0, 1, 0, 0]
    assert cache.step(0, counts, plan(counts, [None, CPU, None, None]), None) == []
    assert cache.stats.fills_started == 0


def test_make_policy_names():
    res, sh = two_layers([True, False], [False, True])
    assert [make_policy(n, res, sh).name for n in ("static", "lru", "lfu")] == ["static", "lru", "lfu"]
    with pytest.raises(ValueError, match="unknown residency policy"):
        make_policy("fifo", res, sh)
    with pytest.raises(ValueError, match="half-life"):
        make_policy("lfu", res, sh, half_life=0)


# ----------------------------------------------------------------------------------------- mechanism

def eager_cache(res=None):
    """An LFU cache that wants expert 1 of layer 0 at once."""
    res = res or [[True, False], [True, False]]
    shares = [[0.1, 5.0] + [0.2] * (len(res[0]) - 2) for _ in res]
    return ExpertCache(res, DecayedLFUPolicy(res, shares, half_life=8, margin=1.1), HOST)


def test_a_fill_goes_in_the_copy_engines_predicted_idle_time_only():
    cache = eager_cache()
    counts = [0, 1]
    p = plan(counts, [None, CPU])  # CPU queue 1 ms; a copy 4 ms: a quarter of the expert per call
    chunks = []
    for _ in range(3):
        chunks += cache.step(0, counts, p, LM)
    assert all(isinstance(c, Chunk) for c in chunks) and [c.end - c.start for c in chunks] == [250] * 3
    assert [c.start for c in chunks] == [0, 250, 500]
    # a call that copies an expert in keeps the copy engine: the fill waits
    pb = plan([5, 5], [GPU, COPY])
    assert [a for a in cache.step(1, [5, 5], pb, LM) if not isinstance(a, Promote)] == []
    last = cache.step(0, counts, p, LM)
    assert [type(a) for a in last] == [Chunk, Install] and last[0].end == HOST
    assert cache.stats.fill_bytes == HOST and cache.stats.fills == 1 and cache.resident[0] == [False, True]


def test_the_predicted_makespan_bounds_a_fill_with_no_cpu_expert():
    cache = eager_cache([[True, False, True], [True, False, False]])
    counts = [2, 0, 1]  # both resident: the GPU queue's makespan is the window
    p = plan(counts, [GPU, None, GPU])
    (chunk,) = cache.step(0, counts, p, LM)
    assert chunk.end - chunk.start == int(p.makespan / LM.transfer() * HOST)


def test_a_fill_no_longer_worth_a_slot_is_abandoned():
    res = [[True, False], [True, False]]
    pol = DecayedLFUPolicy(res, [[0.1, 5.0], [0.1, 5.0]], half_life=1, margin=1.1)
    cache = ExpertCache(res, pol, HOST)
    counts = [0, 1]
    cache.step(0, counts, plan(counts, [None, CPU]), LM)  # starts the fill of (0, 1)
    for _ in range(20):  # the routing turns to expert 0 everywhere before the copy is in
        cache.step(1, [4, 0], plan([4, 0], [GPU, None]), LM)
        cache.step(0, [4, 0], plan([4, 0], [GPU, None]), LM)
    assert cache.stats.abandoned == 1 and cache.stats.fills == 0 and cache.resident == res


def test_a_plan_that_needs_the_last_copy_buffer_restarts_the_fill():
    cache = eager_cache([[True, False, False, False], [True, False, False, False]])
    counts = [0, 1, 0, 0]
    cache.step(0, counts, plan(counts, [None, CPU, None, None]), LM)  # a quarter in
    assert cache.fill.done == 250
    one = [0, 5, 5, 0]
    # one copy: buffer 0, the fill waits (the copied-in expert itself may be kept: a promotion, not a fill)
    assert [a for a in cache.step(1, one, plan(one, [None, COPY, CPU, None]), LM) if not isinstance(a, Promote)] == []
    assert cache.fill.done == 250 and cache.stats.restarted == 0
    two = [0, 5, 5, 0]
    cache.step(1, two, plan(two, [None, COPY, COPY, None]), LM)  # both buffers: the fill's bytes are gone
    assert cache.fill.done == 0 and cache.stats.restarted == 1


def test_an_adaptive_policy_costs_no_budget():
    """A fill goes through the last copy buffer: the reservation and the placement are the static one's."""
    ex_static = build_executor(CFG, make_experts(), gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                               placement="fraction:0.25", latency_model=MIX)
    ex_lfu = build_executor(CFG, make_experts(), gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                            placement="fraction:0.25", latency_model=MIX, residency="lfu")
    assert ex_lfu.placement.to_dict() == ex_static.placement.to_dict()
    assert len(ex_lfu.buffers) == len(ex_static.buffers)
    # but every expert keeps a host copy (an evicted one must still be somewhere)
    assert sum(h is not None for row in ex_lfu.host for h in row) == CFG.num_layers * CFG.num_experts
    assert sum(h is not None for row in ex_static.host for h in row) == 12


# ----------------------------------------------------------------------------------------- executor

def run_executor(dtype, quant, residency, steps=24):
    experts = make_experts(dtype=dtype)
    if quant is not None:
        from fiddler.quant import quantize_experts

        experts = quantize_experts(experts, quant)
    keep = [list(r) for r in experts]
    ex = build_executor(CFG, experts, gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                        placement="fraction:0.25", planner="makespan", latency_model=MIX, residency=residency,
                        dtype=torch.bfloat16 if quant else dtype, quant=quant)
    outs = []
    for step in range(steps):
        x, idx, w = routing(16 if step == 0 else 1, seed=step, dtype=torch.float32 if quant else dtype)
        outs.append([(ex.forward(l, x, idx, w), x, idx, w) for l in range(CFG.num_layers)])
    return ex, keep, outs


@pytest.mark.parametrize("residency", ["lru", "lfu"])
def test_executor_fills_exact_fp32(residency):
    ex, experts, outs = run_executor(torch.float32, None, residency)
    for step in outs:
        for layer, (out, x, idx, w) in enumerate(step):
            assert torch.equal(out, reference(experts[layer], x, idx, w))
    r = ex.stats.residency
    assert r["policy"] == residency and r["evictions"] == r["fills"] + r["promoted"] >= 1
    assert ex.cache.resident != ex.placement.resident  # the set moved
    assert sum(map(sum, ex.cache.resident)) == ex.placement.num_resident


@pytest.mark.parametrize("dtype,quant", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "q8_0")])
def test_installed_slots_hold_the_experts_bytes(dtype, quant):
    """Whatever the host format (as given, packed for the kernel, quantized blocks), a fill unpacks into the
    evicted slot exactly the device copy a resident expert of that id has at load."""
    if dtype == torch.bfloat16:
        from fiddler.kernel_loader import load_kernels

        if load_kernels() is None:
            pytest.skip("the packed host format needs the C++ kernel")
    ex, experts, _ = run_executor(dtype, quant, "lfu", steps=30)
    assert ex.stats.residency["fills"] >= 1 and ex.stats.residency["promoted"] >= 1  # both ways into a slot
    for l, row in enumerate(ex.resident):
        for e, slot in enumerate(row):
            assert (slot is not None) == ex.cache.resident[l][e]
            if slot is not None:
                want = ex._device_copy(experts[l][e])
                for a, b in ((slot.w1, want.w1), (slot.w3, want.w3), (slot.w2, want.w2)):
                    assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------- engine

@pytest.mark.parametrize("residency", ["lru", "lfu"])
def test_engine_greedy_and_beams_match_transformers_with_fills(residency):
    """0 / 50 / 100% resident: the same tokens as transformers; fills and evictions at 50%."""
    from fiddler import Engine
    from fiddler.executors import FiddlerPolicy
    from tests.models import hf_model, model_path, prompt

    hf = hf_model("e8k2", torch.float32)
    ids = prompt(12, hf.config.vocab_size, seed=3)
    greedy = hf.generate(ids[None], max_new_tokens=10, do_sample=False)[0, 12:]
    beams = hf.generate(ids[None], max_new_tokens=6, do_sample=False, num_beams=3, early_stopping=False,
                        length_penalty=1.0)[0, 12:]
    for placement in ("none", "fraction:0.5", "all"):
        eng = Engine.from_pretrained(model_path("e8k2"), dtype=torch.float32, gpu=GpuSide.emulated(1 << 40),
                                     executor=FiddlerPolicy(placement=placement, latency_model=MIX,
                                                            residency=residency))
        fills = 0
        out = eng.generate(ids, max_new_tokens=10)
        fills += eng.executor.stats.residency.get("fills", 0)
        assert out.tokens.tolist() == greedy.tolist(), placement
        out = eng.generate(ids, max_new_tokens=6, beam_width=3)
        fills += eng.executor.stats.residency.get("fills", 0)
        assert out.tokens.tolist() == beams.tolist(), placement
        if placement == "fraction:0.5":
            assert fills >= 1
        else:
            assert fills == 0


# ----------------------------------------------------------------------------------------- harness

def test_the_harness_key_reaches_the_simulator(tmp_path):
    from runners.main import run_job
    from tests.test_harness import cfg_of as compose

    recs = {}
    for pol in ("static", "lfu"):
        (rec,) = run_job(compose("mode=simulate", "system=fiddler", "model=mixtral_8x7b", "environment=rtx4090",
                                 f"system.residency={pol}", "sim.reuse=0", "workload.input_lens=[16]",
                                 "workload.output_lens=[32]", "run.progress=false",
                                 f"run.index_path={tmp_path / 'index.jsonl'}"), tmp_path / pol)
        assert rec["status"] == "ok", rec.get("reason")
        recs[pol] = rec
    assert recs["static"]["stats"]["executor"]["residency"] == {"policy": "static"}
    lfu = recs["lfu"]["stats"]["executor"]["residency"]
    assert lfu["policy"] == "lfu" and lfu["evictions"] == lfu["fills"] + lfu["promoted"]
    assert recs["lfu"]["system_info"]["placement"] == recs["static"]["system_info"]["placement"]


def test_a_bad_policy_name_is_refused_at_start():
    from tests.test_harness import cfg_of

    with pytest.raises(Exception, match=r"system.residency=fifo") as e:
        cfg_of("system=fiddler", "system.residency=fifo")
    assert "expected one of [static, lru, lfu]" in str(e.value.__cause__ or e.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fills_and_promotions_through_the_copy_stream(dtype):
    """On CUDA a fill's chunks go on the copy stream and its unpack waits for them by event: the outputs and the
    slots must be right without any host synchronisation in between."""
    experts = make_experts(dtype=dtype)
    keep = [list(r) for r in experts]
    ex = build_executor(CFG, experts, gpu=GpuSide.cuda(BIG), max_seq_len=64, max_batch=1,
                        placement="fraction:0.25", latency_model=MIX, residency="lfu", dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 0.02
    for step in range(30):
        x, idx, w = routing(16 if step == 0 else 1, seed=step, dtype=dtype)
        for layer in range(CFG.num_layers):
            got = ex.forward(layer, x.cuda(), idx.cuda(), w.cuda()).cpu().float()
            ref = reference([ExpertWeights(e.w1.float(), e.w3.float(), e.w2.float()) for e in keep[layer]],
                            x.float(), idx, w.float())
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol * float(ref.abs().max()))
    torch.cuda.synchronize()
    r = ex.stats.residency
    assert r["fills"] >= 1 and r["promoted"] >= 1
    for l, row in enumerate(ex.resident):
        for e, slot in enumerate(row):
            if slot is not None:
                want = ex._device_copy(keep[l][e])
                assert all(torch.equal(a, b) for a, b in ((slot.w1, want.w1), (slot.w3, want.w3), (slot.w2, want.w2)))


def test_tables_show_the_hit_rate_and_fills_where_records_have_a_resident_set():
    from runners import tables

    def rec(system, executor):
        return {"system": system, "model": "m", "workload": "w", "environment": "e", "mode": "simulate",
                "status": "ok", "point": {"input_len": 8, "output_len": 4, "beam_width": 1}, "time": system,
                "metrics": {"decode_tok_s": 1.0, "repetitions": 1, "valid": True}, "stats": {"executor": executor}}

    lfu = rec("fiddler", {"gpu_hit_rate": 0.25, "residency": {"policy": "lfu", "evictions": 7}})
    other = rec("hf_transformers", {})
    md = tables.to_markdown(tables.build([lfu, other]))
    head, _, row, _ = md.splitlines()[-4:]
    assert "GPU hit" in head and "fills" in head and "0.250" in row and row.rstrip(" |").endswith("7")
    assert "GPU hit" not in tables.to_markdown(tables.build([other]))


def test_the_simulator_replays_the_engines_resident_set(tmp_path):
    """Execute on the emulated GPU with the routing and the engine's latency model recorded, then simulate that
    routing deciding with that latency model (sim.latency_model=trace): the same plans, fills and promotions, so
    the same hits, fill by fill (scripts/residency_trace_check.py does this on small_mixtral). Whether the
    calibrated model lets a fill happen here is the machine's; the test below fixes one that does."""
    from fiddler.config import MoEConfig
    from fiddler.placement import reservation
    from fiddler.sim import RoutingTrace
    from runners.main import prepare, resolve_model_path, run_job
    from tests.test_harness import cfg_of as compose

    cfg = MoEConfig.from_pretrained(resolve_model_path(prepare(compose("model=tiny_mixtral"))[0]))
    dt = torch.bfloat16
    gb = (sum(reservation(cfg, dt, 64, 1).values()) + cfg.num_moe_layers * 2 * cfg.expert_bytes(dt)) / 2**30
    common = ["system=fiddler", "model=tiny_mixtral", f"system.gpu_budget_gb={gb}", "system.residency=lfu",
              "workload.input_lens=[32]", "workload.output_lens=[32]", "run.progress=false",
              f"run.index_path={tmp_path / 'index.jsonl'}"]
    (ex,) = run_job(compose(*common, "environment=local", "system.record_routing=true", "workload.repetitions=1",
                            "workload.warmup=0", "run.isolation=inline"), tmp_path / "ex")
    assert ex["status"] == "ok", ex.get("reason")
    assert RoutingTrace.load(ex["routing_trace"]).meta["latency_model"]["source"] == "calibrated"
    (sim,) = run_job(compose(*common, "mode=simulate", "environment=rtx4090", f"sim.trace={ex['routing_trace']}",
                             "sim.latency_model=trace"), tmp_path / "sim")
    assert sim["status"] == "ok", sim.get("reason")
    assert sim["simulation"]["latency_model"].startswith("the recorded engine's")
    e, s = ex["stats"]["executor"], sim["stats"]["executor"]
    for key in ("fills", "promoted", "evictions", "abandoned"):
        assert e["residency"][key] == s["residency"][key], key
    assert e["tokens"] == s["tokens"]  # kinds a, b, c alike: the same plans, the same hits (kind a)


def test_a_replayed_latency_model_needs_a_trace():
    from runners.main import prepare
    from runners.schema import ConfigError
    from tests.test_harness import cfg_of

    with pytest.raises(ConfigError, match="sim.latency_model"):
        prepare(cfg_of("mode=simulate", "sim.latency_model=trace"))


def test_the_simulators_cache_is_the_engines_on_the_same_inputs():
    """The engine with a fixed latency model, its routing recorded; the simulator on that routing with that
    latency model and the same placement: the same fills, promotions and hits."""
    from fiddler import Engine
    from fiddler.executors import FiddlerPolicy
    from fiddler.latency import HardwareSpec
    from fiddler.sim import Efficiency, FiddlerSimPolicy, SimContext, SimHardware, TraceRouting, simulate
    from fiddler.sim.trace import RoutingRecorder
    from tests.models import model_path, prompt

    eng = Engine.from_pretrained(model_path("e8k2"), dtype=torch.float32, gpu=GpuSide.emulated(1 << 40),
                                 max_seq_len=64, max_batch=1,
                                 executor=FiddlerPolicy(placement="fraction:0.25", latency_model=MIX, residency="lfu"))
    rec = RoutingRecorder.for_config(eng.config)
    eng.executor.attach_recorder(rec)
    eng.generate(prompt(16, eng.config.vocab_size, seed=1), max_new_tokens=24)
    pol = FiddlerSimPolicy(placement=eng.executor.placement, residency="lfu")
    pol.latency_model_override = MIX.to_dict()
    hw = SimHardware.build(HardwareSpec(1000, 100, 10, 100, 8, "avx2", 8), Efficiency.for_classes("amd_zen"),
                           measured_limit=False)
    ctx = SimContext(eng.config, torch.float32, hw, 1 << 40, max_seq_len=64, max_batch=1)
    pol.setup(ctx)
    got = simulate(pol, ctx, TraceRouting(rec.trace()), 16, 24, 1).stats
    want = eng.executor.stats
    assert want.residency["fills"] >= 1 and want.residency["promoted"] >= 1
    assert got["residency"] == want.residency and got["tokens"] == want.tokens  # and so the hits (kind a)


def test_batched_requests_with_an_adaptive_set_match_each_alone(residency="lfu"):
    """Continuous batching (the server's engine) while the resident set moves: every request's tokens are
    those it gets alone on the CPU-only engine (tests/test_batch.py's workload)."""
    from fiddler import Engine
    from fiddler.batch import BatchEngine
    from fiddler.executors import FiddlerPolicy
    from runners.models import synthetic_model
    from tests.models import MIX_LATENCY
    from tests.test_batch import OUTPUT_LENS, SEQ, SLOTS, alone, params, prompts

    e = Engine.from_pretrained(synthetic_model("tiny_mixtral"), dtype=torch.float32, max_batch=SLOTS, max_seq_len=SEQ,
                               gpu=GpuSide.emulated(1 << 40),
                               executor=FiddlerPolicy(placement="fraction:0.5", latency_model=MIX_LATENCY,
                                                      residency=residency))
    be = BatchEngine(e, token_budget=128)
    assert be.generate(prompts("tiny_mixtral"), [params(n) for n in OUTPUT_LENS]) == alone("tiny_mixtral")
    assert e.executor.stats.residency["evictions"] >= 1
