"""Property tests (hypothesis): every routed token is computed exactly once, placement never exceeds
the GPU budget, the makespan planner is never worse than all-CPU / all-GPU (nor the paper's rule)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fiddler.config import MoEConfig
from fiddler.executors import GpuSide, build_executor
from fiddler.latency import LatencyModel
from fiddler.placement import place, reservation
from fiddler.planner import COPY, CPU, GPU, PLANNERS, get_planner
from fiddler.popularity import Popularity
from tests.test_executor import make_experts, reference

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

latency_models = st.builds(
    lambda ca, cb, ga, gb, tr, fl: LatencyModel.manual(cpu=(ca, cb), gpu=(ga, gb), transfer=tr, gpu_floor=fl),
    st.floats(0, 1e-2), st.floats(0, 1e-1), st.floats(0, 1e-3), st.floats(0, 1e-2), st.floats(0, 1e-1),
    st.floats(0, 1e-2),
)


@st.composite
def layer_cases(draw, max_experts=14):
    E = draw(st.integers(1, max_experts))
    counts = draw(st.lists(st.integers(0, 300), min_size=E, max_size=E))
    resident = draw(st.lists(st.booleans(), min_size=E, max_size=E))
    return counts, resident, draw(latency_models)


@SETTINGS
@given(layer_cases(), st.sampled_from(sorted(PLANNERS)))
def test_every_routed_expert_gets_exactly_one_decision(case, planner):
    counts, resident, lm = case
    p = get_planner(planner)(counts, resident, lm)
    for n, r, d in zip(counts, resident, p.decisions):
        if n == 0:
            assert d is None
        elif r:
            assert d == GPU
        else:
            assert d in (COPY, CPU)
    assert sum(p.tokens(k) for k in (GPU, COPY, CPU)) == sum(counts)


@SETTINGS
@given(layer_cases())
def test_makespan_never_worse_than_all_cpu_all_gpu_or_paper(case):
    counts, resident, lm = case
    best = get_planner("makespan")(counts, resident, lm).makespan
    for other in ("cpu", "gpu", "paper"):
        assert best <= get_planner(other)(counts, resident, lm).makespan


@st.composite
def model_configs(draw):
    heads = draw(st.sampled_from([2, 4, 8]))
    return MoEConfig(hidden_size=draw(st.sampled_from([32, 64, 4096])), intermediate_size=draw(st.sampled_from([48, 14336])),
                     num_layers=draw(st.integers(1, 32)), num_experts=draw(st.sampled_from([2, 4, 8, 16])),
                     top_k=draw(st.sampled_from([1, 2])), num_heads=heads, num_kv_heads=draw(st.sampled_from([1, 2])),
                     head_dim=draw(st.sampled_from([8, 128])), vocab_size=draw(st.sampled_from([64, 32000])))


@SETTINGS
@given(model_configs(), st.integers(0, 1 << 40), st.sampled_from(["popularity", "random"]),
       st.sampled_from([torch.bfloat16, torch.float32]), st.integers(1, 4096), st.integers(1, 8), st.integers(0, 3))
def test_placement_never_exceeds_budget(cfg, budget, strategy, dtype, seq, batch, seed):
    g = torch.Generator().manual_seed(seed)
    pop = Popularity(torch.randint(0, 100, (cfg.num_layers, cfg.num_experts), generator=g).tolist(), top_k=cfg.top_k)
    need = sum(reservation(cfg, dtype, seq, batch).values())
    try:
        pl = place(cfg, dtype, budget, max_seq_len=seq, max_batch=batch, strategy=strategy, popularity=pop, seed=seed)
    except ValueError:
        assert budget < need
        return
    assert pl.gpu_bytes <= budget
    # and it is not wasteful: one more expert would not fit (unless all are resident)
    total = cfg.num_layers * cfg.num_experts
    assert pl.num_resident == total or pl.gpu_bytes + cfg.expert_bytes(dtype) > budget


CFG = MoEConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_experts=6, top_k=2, num_heads=4,
                num_kv_heads=2, head_dim=8, vocab_size=64)
EXPERTS = make_experts(CFG)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.lists(st.booleans(), min_size=12, max_size=12), latency_models,
       st.sampled_from(["paper", "makespan"]), st.integers(0, 2**31 - 1), st.booleans())
def test_executor_computes_every_routed_token_exactly_once(T, mask, lm, planner, seed, overlap):
    resident = [mask[:6], mask[6:]]
    pl = place(CFG, torch.float32, 1 << 40, max_seq_len=64, max_batch=1, strategy="mask", mask=resident)
    ex = build_executor(CFG, EXPERTS, gpu=GpuSide.emulated(1 << 40), max_seq_len=64, max_batch=1,
                        placement=pl, planner=planner, latency_model=lm, overlap=overlap)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 32, generator=g)
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g)
    for layer in (0, 1):
        out = ex.forward(layer, x, idx, w)
        torch.testing.assert_close(out, reference(EXPERTS[layer], x, idx, w), rtol=0, atol=1e-6)
    s = ex.stats
    assert s.routed_tokens == 2 * idx.numel() == sum(s.tokens.values())
    counts = torch.bincount(idx.flatten(), minlength=6).tolist()
    for layer in (0, 1):
        ls = s.layers[layer]
        assert ls.tokens[GPU] == sum(n for n, r in zip(counts, resident[layer]) if r)
        assert ls.tokens[COPY] + ls.tokens[CPU] == sum(n for n, r in zip(counts, resident[layer]) if not r)
    assert s.bytes_h2d_weights == s.weight_copies * CFG.expert_bytes(torch.float32)
    ex.close()
