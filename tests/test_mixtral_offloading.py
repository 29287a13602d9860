"""system=mixtral_offloading: the Mixtral-Offloading policy (LRU expert cache + speculative prefetch) in
fiddler's engine. Exact against transformers in fp32; hit/miss/byte counts equal an independent LRU
replay of the recorded routing; prefetch guesses equal the next layer's router recomputed from
transformers' weights; cache sizing; HQQ quantization (when hqq is installed) and its absence."""

from __future__ import annotations

import builtins
import functools
from collections import OrderedDict

import pytest
import torch

from systems.base import ModelSpec, RunContext, SystemUnavailable
from systems.mixtral_offloading import DEFAULT_CACHE_SIZE, derive_cache_size, load_engine
from systems.mixtral_offloading.adapter import MixtralOffloadingAdapter
from systems.mixtral_offloading.config import MixtralOffloadingConfig
from fiddler.config import MoEConfig
from fiddler.executors import ExpertWeights
from fiddler.gpu_side import GpuSide
from fiddler.placement import reservation
from tests.models import ARCHS, hf_model, model_path, prompt

pytest.importorskip("transformers")


@functools.cache
def hf(arch: str):
    return hf_model(arch, torch.float32)


def engine(arch: str, **kw):
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("gpu", GpuSide.none())  # the CPU stands in for the GPU; test_cuda_side_stream_copies asks for CUDA
    return load_engine(model_path(arch), **kw)


# ---------------------------------------------------------------- exactness (fp32, unquantized)

@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("cache_size", [1, 4])
def test_greedy_identical_to_transformers(cache_size, prefetch):
    ids = prompt(12, ARCHS["e8k2"]["vocab_size"])
    ref = hf("e8k2").generate(ids[None], max_new_tokens=12, do_sample=False)[0, 12:].tolist()
    eng = engine("e8k2", cache_size=cache_size, prefetch=prefetch)
    out = eng.generate(ids, max_new_tokens=12)
    assert out.tokens.tolist() == ref
    st = eng.executor.stats
    assert st.misses > 0 and st.hits + st.misses == st.experts_routed  # the cache was exercised
    assert st.experts["c"] == 0 and st.tokens["c"] == 0  # experts never run on the CPU side
    assert (st.prefetch_calls > 0) == prefetch
    assert eng.info()["executor_info"]["cache_size"] == cache_size


def test_beam_and_odd_shapes_identical_to_transformers():
    """16 experts, top-4, 3 layers, prefetch_k (= top_k = 4) above the cache size (2): beam search of 3."""
    arch = "e16k4_odd"
    ids = prompt(10, ARCHS[arch]["vocab_size"], seed=3)
    ref = hf(arch).generate(ids[None], max_new_tokens=8, num_beams=3, do_sample=False, output_scores=True,
                            return_dict_in_generate=True)
    eng = engine(arch, cache_size=2, prefetch=True)
    out = eng.generate(ids, max_new_tokens=8, beam_width=3)
    assert out.tokens.tolist() == ref.sequences[0, 10:].tolist()
    assert out.sequences_scores == pytest.approx(float(ref.sequences_scores[0]), abs=1e-4)
    info = eng.info()["executor_info"]
    assert info["prefetch_k"] == 4 and info["prefetch_k_effective"] == 2


# ---------------------------------------------------------------- LRU replay

def replay(trace, start, cache_size):
    """Independent LRU over the recorded events: plain OrderedDicts, expert -> None, LRU first.
    Forward events: distinct routed experts in id order; cached ones become most recent, then each miss
    evicts the least recent. Prefetch events: guessed experts already cached become most recent, then each
    missing guess evicts the least recent and is inserted."""
    caches = [OrderedDict((e, None) for e in s) for s in start]
    prefetched = [set() for _ in start]
    out = []
    for ev in trace:
        c = caches[ev["layer"]]
        pf = prefetched[ev["layer"]]
        if "topk_idx" in ev:
            active = sorted(set(ev["topk_idx"].reshape(-1).tolist()))
            hits = [e for e in active if e in c]
            misses = [e for e in active if e not in c]
            pf_hits = [e for e in hits if e in pf]
            pf -= set(hits)
            for e in hits:
                c.move_to_end(e)
            for e in misses:
                if len(c) >= cache_size:
                    pf.discard(c.popitem(last=False)[0])
                c[e] = None
            out.append(("forward", hits, misses, pf_hits))
        else:
            guesses = ev["guesses"]
            for e in guesses:
                if e in c:
                    c.move_to_end(e)
            copied = []
            for e in guesses:
                if e not in c:
                    if len(c) >= cache_size:
                        pf.discard(c.popitem(last=False)[0])
                    c[e] = None
                    pf.add(e)
                    copied.append(e)
            out.append(("prefetch", copied))
        assert len(c) <= cache_size
    return out, [list(c) for c in caches]


def assert_slots_hold_their_experts(ex):
    """Every cache slot holds exactly the bytes of the expert the LRU says it holds."""
    for l, od in enumerate(ex.lru):
        assert len(od) == ex.cache_size and sorted(od.values()) == list(range(ex.cache_size))
        for e, s in od.items():
            assert all(torch.equal(a, b) for a, b in zip(ex.slots[l][s], ex.host[l][e]))


def run_traced(arch, cache_size, prefetch, beam=2, new=6, seed=1):
    eng = engine(arch, cache_size=cache_size, prefetch=prefetch)
    E, L = ARCHS[arch]["num_local_experts"], ARCHS[arch]["num_hidden_layers"]
    eng.executor.start_trace()
    # documented initial state: the last cache_size experts of each layer, lowest id least recently used
    assert eng.executor.trace_start == [list(range(E - cache_size, E))] * L
    eng.generate(prompt(9, ARCHS[arch]["vocab_size"], seed=seed), max_new_tokens=new, beam_width=beam)
    return eng, eng.executor.trace


@pytest.mark.parametrize("cache_size", [2, 6])
def test_counts_equal_independent_lru_replay_without_prefetch(cache_size):
    arch = "e16k4_odd"
    eng, trace = run_traced(arch, cache_size, prefetch=False)
    ex, st = eng.executor, eng.executor.stats
    E, L = ARCHS[arch]["num_local_experts"], ARCHS[arch]["num_hidden_layers"]
    expected, final = replay(trace, [list(range(E - cache_size, E))] * L, cache_size)
    assert all(kind == "forward" for kind, *_ in expected)
    hits = sum(len(h) for _, h, _, _ in expected)
    misses = sum(len(m) for _, _, m, _ in expected)
    assert (st.hits, st.misses) == (hits, misses)
    assert [(ev["hits"], ev["misses"]) for ev in trace] == [(h, m) for _, h, m, _ in expected]
    assert st.bytes_copied == misses * ex.expert_bytes == misses * eng.config.expert_bytes(torch.float32)
    assert st.prefetch_copies == 0 and st.bytes_copied_prefetch == 0
    assert ex.cache_contents() == final
    assert st.hit_rate == pytest.approx(hits / (hits + misses))
    # per layer, and the calls: prefill + (new - 1) decode steps, every layer
    for l in range(L):
        evs = [x for ev, x in zip(trace, expected) if ev["layer"] == l]
        assert (st.layers[l].hits, st.layers[l].misses) == (sum(len(x[1]) for x in evs), sum(len(x[2]) for x in evs))
    assert_slots_hold_their_experts(ex)
    assert st.calls == len(trace) == 6 * L
    assert st.hits > 0 and st.misses > 0


@pytest.mark.parametrize("cache_size", [2, 6])
def test_prefetch_invariants_and_replay(cache_size):
    arch = "e16k4_odd"
    eng, trace = run_traced(arch, cache_size, prefetch=True)
    ex, st = eng.executor, eng.executor.stats
    E, L = ARCHS[arch]["num_local_experts"], ARCHS[arch]["num_hidden_layers"]
    forwards = [ev for ev in trace if "topk_idx" in ev]
    # every routed expert computed exactly once per layer call
    for ev in forwards:
        routed = sorted(set(ev["topk_idx"].reshape(-1).tolist()))
        assert sorted(ev["computed"]) == routed and len(ev["computed"]) == len(set(ev["computed"]))
    assert st.experts_computed == st.experts_routed == sum(len(ev["computed"]) for ev in forwards)
    assert st.routed_tokens == sum(ev["topk_idx"].numel() for ev in forwards)
    # bytes = (misses + prefetch copies) x expert bytes
    assert st.bytes_copied == (st.misses + st.prefetch_copies) * ex.expert_bytes
    assert st.prefetch_hits + st.prefetch_evicted_unused <= st.prefetch_copies
    # one prefetch per layer call except the last layer's; guesses capped at the cache size
    prefetches = [ev for ev in trace if "guesses" in ev]
    assert len(prefetches) == st.prefetch_calls == len(forwards) // L * (L - 1)
    assert all(len(ev["guesses"]) == min(4, cache_size) for ev in prefetches)
    assert all(ev["layer"] >= 1 for ev in prefetches)
    # the whole sequence (forwards and prefetches) replays exactly through a plain LRU
    expected, final = replay(trace, [list(range(E - cache_size, E))] * L, cache_size)
    fw = [x for x in expected if x[0] == "forward"]
    assert [(ev["hits"], ev["misses"]) for ev in forwards] == [(h, m) for _, h, m, _ in fw]
    assert st.prefetch_hits == sum(len(p) for *_, p in fw)
    assert [ev["prefetched"] for ev in prefetches] == [x[1] for x in expected if x[0] == "prefetch"]
    assert ex.cache_contents() == final
    assert_slots_hold_their_experts(ex)


def test_prefetch_guess_is_next_layers_router_on_the_residual():
    """The guess for layer i+1 = top-k of summed softmax(gate_{i+1}(RMSNorm_{i+1}(x))) over tokens, with x
    the residual stream after layer i's MoE output, recomputed here from transformers' weights."""
    arch = "e16k4_odd"
    eng = engine(arch, cache_size=3, prefetch=True)
    ex = eng.executor
    seen = []
    orig = ex.after_moe

    def spy(layer, x):
        seen.append((layer, x.clone()))
        orig(layer, x)

    ex.after_moe = spy
    ex.start_trace()
    eng.generate(prompt(7, ARCHS[arch]["vocab_size"], seed=5), max_new_tokens=3)
    guesses = [ev for ev in ex.trace if "guesses" in ev]
    layers = hf(arch).model.layers
    checked = 0
    for (layer, x), ev in zip([s for s in seen if s[0] + 1 < len(layers)], guesses):
        nxt = layers[layer + 1]
        h = nxt.post_attention_layernorm(x)
        probs = torch.softmax(torch.nn.functional.linear(h, nxt.mlp.gate.weight).float(), -1).sum(0)
        assert ev["layer"] == layer + 1
        assert ev["guesses"] == torch.topk(probs, 3).indices.tolist()
        checked += 1
    assert checked == len(guesses) > 0


def test_prefetch_on_moe_input_is_exact_and_counted():
    eng = engine("e8k2", cache_size=1, prefetch=True, prefetch_input="moe_input")
    ids = prompt(12, ARCHS["e8k2"]["vocab_size"])
    ref = hf("e8k2").generate(ids[None], max_new_tokens=6, do_sample=False)[0, 12:].tolist()
    assert eng.generate(ids, max_new_tokens=6).tokens.tolist() == ref
    assert eng.executor.stats.prefetch_calls == 6  # layer 0 of each step guesses layer 1


def test_engine_binds_the_model_routers_for_prefetch():
    """The engine calls the executor's bind_model hook itself: the policy works through the plain
    Engine.from_pretrained(..., executor=...), and an executor that was never bound says so."""
    from systems.mixtral_offloading import MixtralOffloadingPolicy, OffloadingExecutor
    from fiddler.engine import Engine

    eng = Engine.from_pretrained(model_path("e8k2"), dtype=torch.float32,
                                 gpu=GpuSide.none(), executor=MixtralOffloadingPolicy(cache_size=2, prefetch=True))
    eng.generate(prompt(4, 512), max_new_tokens=2)
    assert eng.executor.stats.prefetch_calls > 0
    cfg = eng.config
    F_, H = cfg.intermediate_size, cfg.hidden_size
    zero = ExpertWeights(torch.zeros(F_, H), torch.zeros(F_, H), torch.zeros(H, F_))
    unbound = OffloadingExecutor(cfg, [[zero] * cfg.num_experts for _ in range(cfg.num_layers)], device="cpu",
                                 dtype=torch.float32, cache_size=2, cache_size_source="test")
    with pytest.raises(RuntimeError, match="bind_model"):
        unbound.after_moe(0, torch.zeros(1, cfg.hidden_size))


def test_bad_options():
    with pytest.raises(ValueError, match="cache_size"):
        engine("e8k2", cache_size=9)
    with pytest.raises(ValueError, match="prefetch_input"):
        engine("e8k2", cache_size=2, prefetch_input="tomorrow")


# ---------------------------------------------------------------- cache size

CFG = MoEConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_experts=8, top_k=2, num_heads=4,
                num_kv_heads=2, head_dim=16, vocab_size=512)


def test_cache_size_from_budget():
    dt = torch.bfloat16
    res = reservation(CFG, dt, 64, 2)
    base = sum(res.values()) - res["expert_copy_buffers"]  # misses go straight into cache slots
    eb = CFG.expert_bytes(dt)
    for per_layer in (1, 3, 5):
        size, d = derive_cache_size(CFG, dt, base + per_layer * CFG.num_layers * eb + eb - 1, max_seq_len=64,
                                    max_batch=2)
        assert size == per_layer and d["fits_per_layer"] == per_layer and not d["clamped"]
    assert derive_cache_size(CFG, dt, base // 2, max_seq_len=64, max_batch=2)[0] == 1  # at least one
    assert derive_cache_size(CFG, dt, 1 << 40, max_seq_len=64, max_batch=2)[0] == CFG.num_experts
    # a smaller expert (quantized) fits more of them in the same budget
    budget = base + 2 * CFG.num_layers * eb
    assert derive_cache_size(CFG, dt, budget, max_seq_len=64, max_batch=2, expert_bytes=eb // 4)[0] == 8


def adapter(tmp_path, gpu_gb=0.0, dtype="float32", **options):
    spec = ModelSpec(name="e8k2", path=str(model_path("e8k2")), dtype=dtype)
    ctx = RunContext(threads=torch.get_num_threads(), gpu_memory_gb=gpu_gb, has_cuda=torch.cuda.is_available(),
                     cache_dir=str(tmp_path), max_seq_len=64, max_batch=2)
    a = MixtralOffloadingAdapter(MixtralOffloadingConfig.build(**{"prefetch": True, "quantize": False, **options}),
                                 spec, ctx)
    a.load()
    return a


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only sizing rules")
def test_adapter_cache_size_sources(tmp_path):
    a = adapter(tmp_path)
    info = a.info()["executor_info"]
    assert info["cache_size"] == DEFAULT_CACHE_SIZE and info["cache_size_source"].startswith("default")
    cfg = MoEConfig.from_pretrained(model_path("e8k2"))
    res = reservation(cfg, torch.float32, 64, 2)
    need = sum(res.values()) - res["expert_copy_buffers"] + 5 * cfg.num_layers * cfg.expert_bytes(torch.float32)
    gb = (need + 1000) / 2**30  # room for 5 experts per layer, as an emulated budget on a CPU-only host
    a = adapter(tmp_path, gpu_gb=gb)
    info = a.info()["executor_info"]
    assert "environment.gpu.memory_gb" in info["cache_size_source"] and "emulated" in info["cache_size_source"]
    assert info["cache_size"] == 5
    assert adapter(tmp_path, gpu_gb=gb, gpu_budget_gb=gb / 4).info()["executor_info"]["cache_size"] < 5
    a = adapter(tmp_path, gpu_gb=gb, cache_size=3)  # an explicit option wins
    info = a.info()["executor_info"]
    assert info["cache_size"] == 3 and info["cache_size_source"] == "option cache_size"
    from systems.base import GenerationRequest

    calls = []
    res = a.generate(GenerationRequest(input_ids=prompt(8, 512).tolist(), max_new_tokens=4, beam_width=2),
                     lambda: calls.append(1))
    assert len(res.tokens) == 4 and calls == [1]
    ex = res.stats["executor"]
    assert {"hits", "misses", "prefetch_hits", "bytes_copied", "hit_rate"} <= set(ex)
    assert ex["bytes_copied"] == (ex["misses"] + ex["prefetch_copies"]) * info["expert_bytes"]


# ---------------------------------------------------------------- quantization

def test_quantize_without_hqq_is_unavailable(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_hqq(name, *args, **kwargs):
        if name == "hqq" or name.startswith("hqq."):
            raise ImportError("No module named 'hqq'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hqq)
    with pytest.raises(SystemUnavailable, match="hqq"):
        adapter(tmp_path, quantize=True)


def test_hqq_quantized_policy(tmp_path):
    pytest.importorskip("hqq")
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    eng = engine("e8k2", cache_size=2, prefetch=True, quantize=True)
    ex = eng.executor
    cfg = eng.config
    # 2-bit weights (4 per byte) + a scale and a zero per group of 16, in fp32
    assert ex.expert_bytes == cfg.expert_params() // 4 + 2 * (cfg.expert_params() // 16) * 4
    assert ex.expert_bytes < cfg.expert_bytes(torch.float32) // 4
    attn = eng.info()["executor_info"]["attention_quantization"]
    assert attn["quantized_bytes"] < attn["dense_bytes"]
    out = eng.generate(prompt(10, 512), max_new_tokens=5)
    assert out.tokens.shape == (5,)
    st = ex.stats
    assert st.bytes_copied == (st.misses + st.prefetch_copies) * ex.expert_bytes > 0
    # an expert computed from the cache equals the same weights quantized by hqq's HQQLinear and dequantized
    from fiddler.weights import load_weights

    assert_slots_hold_their_experts(ex)
    w = load_weights(model_path("e8k2"), cfg, dtype=torch.float32).experts[1][3]
    ws = ex.codec.dequantize(ex.host[1][3])
    for W, q in zip(ws, (w.w1, w.w3, w.w2)):
        lin = torch.nn.Linear(q.shape[1], q.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(q)
        ref = HQQLinear(lin, BaseQuantizeConfig(nbits=2, group_size=16), compute_dtype=torch.float32,
                        device="cpu").dequantize()
        assert torch.allclose(W, ref, atol=1e-6)
        assert (W - q).abs().max() < q.abs().max()  # a quantization of these weights, not of others


def test_hqq_quantized_policy_bf16_through_the_adapter(tmp_path):
    """quantize: true on a bf16 model, as a user runs it: the CPU kernel serves the dense linears (their
    torch copies are dropped), so attention must be quantized from the dense weights before that."""
    pytest.importorskip("hqq")
    from systems.base import GenerationRequest
    from systems.mixtral_offloading.quant import HQQAttentionLinear

    a = adapter(tmp_path, dtype="bfloat16", quantize=True, cache_size=2)
    eng = a.engine
    from fiddler.weights import load_weights

    dense = load_weights(model_path("e8k2"), eng.config, dtype=torch.bfloat16).layers
    for layer, d in zip(eng.model.layers, dense):
        assert isinstance(layer.qkv_proj, HQQAttentionLinear) and isinstance(layer.o_proj, HQQAttentionLinear)
        for q, w in ((layer.qkv_proj, torch.cat([d.q, d.k, d.v])), (layer.o_proj, d.o)):
            deq = q.layer.dequantize().float()
            assert deq.shape == w.shape and (deq - w.float()).abs().max() < w.float().abs().max()
    info = a.info()
    cfg = eng.config
    assert info["executor_info"]["attention_quantization"]["quantized_bytes"] < \
        info["executor_info"]["attention_quantization"]["dense_bytes"]
    assert eng.executor.expert_bytes == cfg.expert_params() // 4 + 2 * (cfg.expert_params() // 16) * 2
    calls = []
    res = a.generate(GenerationRequest(input_ids=prompt(10, 512).tolist(), max_new_tokens=5, beam_width=2),
                     lambda: calls.append(1))
    assert len(res.tokens) == 5 and calls == [1]
    ex = res.stats["executor"]
    assert ex["bytes_copied"] == (ex["misses"] + ex["prefetch_copies"]) * eng.executor.expert_bytes > 0
    greedy = [a.generate(GenerationRequest(input_ids=prompt(10, 512).tolist(), max_new_tokens=4), lambda: None).tokens
              for _ in range(2)]
    assert greedy[0] == greedy[1]


# ---------------------------------------------------------------- config and CUDA

def test_config_composes_and_checks_ranges():
    from hydra import compose, initialize_config_dir

    import runners  # noqa: F401  (registers schemas)
    from runners.main import prepare
    from runners.schema import ConfigError
    from tests.test_harness import CONF

    def cfg(*o):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("config", overrides=["system=mixtral_offloading", *o])

    conf, _ = prepare(cfg())
    assert (conf.system.cache_size, conf.system.prefetch, conf.system.prefetch_k, conf.system.quantize) == (
        None, True, None, False)
    assert conf.system.default_cache_size == DEFAULT_CACHE_SIZE
    for bad, key in (("system.cache_size=0", "system.cache_size"), ("system.prefetch_k=0", "system.prefetch_k"),
                     ("system.gpu_budget_gb=-1", "system.gpu_budget_gb")):
        with pytest.raises(ConfigError, match=key):
            prepare(cfg(bad))
    with pytest.raises(Exception, match="prefetch_input"):
        cfg("system.prefetch_input=tomorrow")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [False, True])
def test_cuda_side_stream_copies(prefetch):
    """On CUDA: pinned host experts, copies on a side stream ordered by events; logits equal transformers'
    (fp32, to rounding), counts equal the LRU replay, and every slot holds its expert's bytes."""
    arch = "e16k4_odd"
    eng = engine(arch, cache_size=2, prefetch=prefetch, gpu=GpuSide.cuda())
    ex = eng.executor
    assert ex.cuda and ex.host[0][0][0].is_pinned()
    ids = prompt(10, ARCHS[arch]["vocab_size"], seed=3)
    with torch.no_grad():
        ref = hf(arch)(ids[None]).logits[0].float()
    got = eng.forward_logits(ids).cpu()
    assert torch.allclose(got, ref, atol=1e-3, rtol=1e-3)
    ex.start_trace()
    eng.generate(ids, max_new_tokens=6, beam_width=2)
    torch.cuda.synchronize()
    expected, final = replay(ex.trace, ex.trace_start, 2)
    fw = [x for x in expected if x[0] == "forward"]
    assert [(ev["hits"], ev["misses"]) for ev in ex.trace if "topk_idx" in ev] == [(h, m) for _, h, m, _ in fw]
    assert ex.cache_contents() == final
    for l, od in enumerate(ex.lru):
        for e, s in od.items():
            assert all(torch.equal(a.cpu(), b) for a, b in zip(ex.slots[l][s], ex.host[l][e]))
