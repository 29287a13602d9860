"""FiddlerExecutor: decisions a/b/c happen where the plan says, outputs equal a plain reference exactly in
fp32 (and transformers' Mixtral experts), stats are consistent, CPU/GPU-side paths and options."""

from __future__ import annotations

import pytest
import torch

from fiddler import latency
from fiddler.config import MoEConfig
from fiddler.executors import FiddlerExecutor, GpuSide, Threads, build_executor, torch_expert
from fiddler.latency import LatencyModel
from fiddler.placement import place
from fiddler.planner import COPY, CPU, GPU
from fiddler.weights import ExpertWeights

CFG = MoEConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_experts=8, top_k=2, num_heads=4,
                num_kv_heads=2, head_dim=16, vocab_size=128)
BIG = 1 << 40  # an emulated GPU budget that holds everything
# Hand-made latency models that force a decision for non-resident experts under both planners.
LM_CPU = LatencyModel.manual(cpu=(1e-6, 1e-5), gpu=(1e-6, 1e-5), transfer=10.0)  # copying never pays
LM_COPY = LatencyModel.manual(cpu=(1.0, 10.0), gpu=(1e-6, 1e-5), transfer=1e-4)   # the CPU is hopeless
LM_EVEN = LatencyModel.manual(cpu=(1e-4, 1e-2), gpu=(1e-5, 1e-4), transfer=1e-2)  # comparable: balance


def make_experts(cfg=CFG, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, F = cfg.hidden_size, cfg.intermediate_size

    def w(*shape):
        return (torch.randn(*shape, generator=g) / shape[1] ** 0.5).to(dtype)

    return [[ExpertWeights(w(F, H), w(F, H), w(H, F)) for _ in range(cfg.num_experts)] for _ in range(cfg.num_layers)]


def routing(T, cfg=CFG, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(T, cfg.num_experts, generator=g), -1)
    w, idx = torch.topk(probs, cfg.top_k, -1)
    return x, idx, (w / w.sum(-1, keepdim=True)).to(dtype)


def reference(experts, x, idx, w):
    """Plain computation: each expert on its routed tokens (in token order), weighted, summed over slots."""
    T, K = idx.shape
    out = torch.zeros(T, K, x.shape[1], dtype=x.dtype)
    for e, ew in enumerate(experts):
        hit = (idx == e)
        tokens = hit.any(1).nonzero().flatten()
        if len(tokens) == 0:
            continue
        y = torch_expert(ew, x[tokens])
        for row, t in enumerate(tokens.tolist()):
            k = int(hit[t].nonzero())
            out[t, k] = y[row] * w[t, k]
    return out.sum(1)


def check_stats(ex: FiddlerExecutor, routed: int):
    st = ex.stats
    assert sum(st.tokens.values()) == st.routed_tokens == routed
    assert st.weight_copies == st.experts[COPY]
    assert st.bytes_h2d_weights == st.weight_copies * CFG.expert_bytes(ex.dtype)
    assert st.gpu_hit_rate == pytest.approx(st.tokens[GPU] / routed)
    for kind in (GPU, COPY, CPU):
        assert sum(l.tokens[kind] for l in st.layers) == st.tokens[kind]
        assert sum(l.experts[kind] for l in st.layers) == st.experts[kind]
    d = st.to_dict()
    assert d["routed_tokens"] == routed and d["tokens"] == st.tokens and len(d["layers"]) == CFG.num_layers


@pytest.mark.parametrize("planner", ["paper", "makespan"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("lm_name", ["cpu", "copy"])
def test_decisions_and_exact_fp32(planner, fraction, lm_name):
    lm = {"cpu": LM_CPU, "copy": LM_COPY}[lm_name]
    experts = make_experts()
    ex = build_executor(CFG, experts, gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                        placement=f"fraction:{fraction}", planner=planner, latency_model=lm)
    routed = 0
    for T, seed in ((40, 1), (1, 2), (3, 3)):
        x, idx, w = routing(T, seed=seed)
        for layer in range(CFG.num_layers):
            out = ex.forward(layer, x, idx, w)
            assert torch.equal(out, reference(experts[layer], x, idx, w))
            routed += idx.numel()
    check_stats(ex, routed)
    kinds = {k for k, n in ex.stats.tokens.items() if n}
    non_resident = {"cpu": CPU, "copy": COPY}[lm_name]
    expected = {0.0: {non_resident}, 0.5: {GPU, non_resident}, 1.0: {GPU}}[fraction]
    assert kinds == expected
    if fraction == 1.0:
        assert ex.buffers == [] and ex.stats.weight_copies == 0


@pytest.mark.parametrize("planner", ["paper", "makespan"])
def test_all_three_kinds_in_one_layer(planner):
    """Half resident, and a latency model where the choice between copy and CPU depends on the load:
    a, b and c all occur within single forward calls, still exact."""
    experts = make_experts()
    # paper rule here: copy iff 10 ms + 0.1 ms + 10 us * s < 1 ms + 0.1 ms * s, i.e. s > 101 tokens
    lm = LatencyModel.manual(cpu=(1e-4, 1e-3), gpu=(1e-5, 1e-4), transfer=1e-2)
    ex = build_executor(CFG, experts, gpu=GpuSide.emulated(BIG), max_seq_len=256, max_batch=1,
                        placement="fraction:0.5", planner=planner, latency_model=lm)
    x, idx, w = routing(200, seed=5)
    # non-resident expert 4 gets >= 120 tokens, the other non-resident ones ~50 each
    idx[:120, 0] = 4
    idx[:120, 1] = torch.where(idx[:120, 1] == 4, 5, idx[:120, 1])
    out = ex.forward(0, x, idx, w)
    assert torch.equal(out, reference(experts[0], x, idx, w))
    last = ex.stats.layers[0].last_decisions
    assert {GPU, COPY, CPU} <= set(last), last
    check_stats(ex, idx.numel())


def test_matches_transformers_mixtral_experts():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MoEConfig(hidden_size=64, intermediate_size=96, num_layers=1, num_experts=8, top_k=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, vocab_size=128)
    experts = make_experts(cfg)
    ex = build_executor(cfg, experts, gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                        placement="fraction:0.5", planner="makespan", latency_model=LM_EVEN)
    for impl in ("grouped_mm", "eager"):
        hc = MixtralConfig(hidden_size=64, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)
        hc._experts_implementation = impl
        m = MixtralExperts(hc)
        with torch.no_grad():
            m.gate_up_proj.copy_(torch.stack([torch.cat([e.w1, e.w3]) for e in experts[0]]))
            m.down_proj.copy_(torch.stack([e.w2 for e in experts[0]]))
        for T, seed in ((1, 0), (1, 1), (4, 2), (37, 3)):
            x, idx, w = routing(T, cfg, seed=seed)
            with torch.no_grad():
                ref = m(x, idx, w)
            got = ex.forward(0, x, idx, w)
            if T == 1:  # decode: bit-identical
                assert torch.equal(got, ref), impl
            else:  # MKL's GEMM rounding depends on a row's position in the batch; transformers orders rows differently
                torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)


def test_no_gpu_runs_everything_on_cpu():
    experts = make_experts()
    ex = build_executor(CFG, experts, gpu=GpuSide.none(), max_seq_len=64, max_batch=1)
    assert ex.placement.num_resident == 0 and ex.buffers == [] and ex.latency_model is None
    assert ex.info()["gpu_side"] is None and ex.info()["planner"] == "cpu"
    x, idx, w = routing(9, seed=7)
    assert torch.equal(ex.forward(1, x, idx, w), reference(experts[1], x, idx, w))
    assert ex.stats.tokens == {GPU: 0, COPY: 0, CPU: idx.numel()} and ex.stats.gpu_hit_rate == 0
    check_stats(ex, idx.numel())


def test_threaded_overlap_equals_serial():
    """overlap=True runs the CPU queue on the worker thread with half the cores, concurrently."""
    experts = make_experts()
    kw = dict(gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1, placement="fraction:0.5",
              planner="makespan", latency_model=LM_CPU)
    a = build_executor(CFG, experts, overlap=True, **kw)
    b = build_executor(CFG, experts, overlap=False, **kw)
    assert a.threads.overlap and not b.threads.overlap
    for T in (1, 16, 64):
        x, idx, w = routing(T, seed=T)
        ya, yb = a.forward(0, x, idx, w), b.forward(0, x, idx, w)
        torch.testing.assert_close(ya, yb, rtol=0, atol=1e-6)
        assert torch.equal(ya, reference(experts[0], x, idx, w)) or T > 1
    assert a.stats.tokens[CPU] > 0 and a.stats.tokens[GPU] > 0 and a.stats.cpu_queue_s > 0
    a.close()


def test_bf16_cpu_path_close_to_fp32():
    """bf16: the CPU path uses the packed C++ kernel when it is built (else torch); both sides of the
    plan stay within bf16 rounding of an fp32 computation on the same (bf16-rounded) weights."""
    experts = make_experts(dtype=torch.bfloat16)
    ex = build_executor(CFG, experts, gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                        placement="fraction:0.5", planner="makespan", latency_model=LM_CPU)
    x, idx, w = routing(24, dtype=torch.bfloat16, seed=9)
    got = ex.forward(0, x, idx, w).float()
    ref = reference([ExpertWeights(e.w1.float(), e.w3.float(), e.w2.float()) for e in experts[0]],
                    x.float(), idx, w.float())
    assert ex.stats.tokens[CPU] > 0 and ex.stats.tokens[GPU] > 0
    torch.testing.assert_close(got, ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))
    if ex.kernel is not None:
        assert ex.info()["cpu_expert_path"].startswith("kernel:")


def test_bf16_decode_row_fused_equals_general_path(monkeypatch):
    """One token, every routed expert on the CPU: the executor runs them in one kernel call
    (fiddler.kernels.moe_ffn) with the same result and the same accounting as the general path."""
    experts = make_experts(dtype=torch.bfloat16)
    kw = dict(gpu=GpuSide.none(), max_seq_len=64, max_batch=1)
    fused, general = build_executor(CFG, experts, **kw), build_executor(CFG, experts, **kw)
    if fused.kernel is None:
        pytest.skip("kernel library not built")
    calls = []
    real = fused.kernel.moe_ffn
    monkeypatch.setattr(fused.kernel, "moe_ffn", lambda *a, **k: calls.append(1) or real(*a, **k))
    general.fused_decode = False  # force the general path
    for seed in range(6):
        x, idx, w = routing(1, dtype=torch.bfloat16, seed=seed)
        assert torch.equal(fused.forward(seed % CFG.num_layers, x, idx, w), general.forward(seed % CFG.num_layers, x, idx, w))
    assert len(calls) == 6  # the fused path really ran
    assert fused.stats.tokens == general.stats.tokens == {GPU: 0, COPY: 0, CPU: 6 * CFG.top_k}
    assert [ls.tokens for ls in fused.stats.layers] == [ls.tokens for ls in general.stats.layers]
    check_stats(fused, 6 * CFG.top_k)
    with pytest.raises(ValueError, match="expert ids"):
        fused.forward(0, x, torch.tensor([[0, CFG.num_experts]]), w)
    # an emulated GPU whose plan keeps a resident expert on the GPU side: not the fused case
    emul = build_executor(CFG, experts, gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                          placement="all", planner="makespan", latency_model=LM_CPU)
    calls.clear()
    x, idx, w = routing(1, dtype=torch.bfloat16, seed=1)
    emul.forward(0, x, idx, w)
    assert emul.stats.tokens[GPU] == CFG.top_k and calls == []


def test_recorder_and_info():
    ex = build_executor(CFG, make_experts(), gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                        placement="popularity", planner="paper", latency_model=LM_EVEN)
    rec = ex.attach_recorder()
    x, idx, w = routing(10, seed=11)
    for layer in range(CFG.num_layers):
        ex.forward(layer, x, idx, w)
    assert rec.popularity().counts[1] == torch.bincount(idx.flatten(), minlength=8).tolist()
    info = ex.info()
    assert info["planner"] == "paper" and info["placement"]["num_resident"] == 16
    assert info["latency_model"]["cpu_a"] == LM_EVEN.cpu_a and info["gpu_side"] == "cpu (emulated GPU)"
    ex.reset_stats()
    assert ex.stats.calls == 0 and ex.stats.gpu_hit_rate is None


def test_calibrated_latency_model_is_cached():
    latency.clear_cache()
    experts = make_experts()
    kw = dict(gpu=GpuSide.emulated(BIG), max_seq_len=32, max_batch=1, placement="fraction:0.5")
    a = build_executor(CFG, experts, **kw)
    lm = a.latency_model
    assert lm.source == "calibrated" and [s for s, _ in lm.samples["cpu"]] == [1, 2, 4, 8, 16, 32]
    assert lm.cpu(1) > 0 and lm.gpu(1) > 0 and lm.transfer() > 0
    assert a.stats.weight_copies == 0  # calibration copies are not counted
    b = build_executor(CFG, experts, **kw)
    assert b.latency_model is lm


def test_input_validation():
    experts = make_experts()
    ex = build_executor(CFG, experts, gpu=GpuSide.emulated(BIG), max_seq_len=64, max_batch=1,
                        latency_model=LM_EVEN)
    x, idx, w = routing(4)
    with pytest.raises(TypeError, match="dtype"):
        ex.forward(0, x.double(), idx, w)
    bad = idx.clone()
    bad[0, 0] = 8
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        ex.forward(0, x, bad, w)
    with pytest.raises(ValueError, match="experts must be"):
        build_executor(CFG, experts[:1], gpu=GpuSide.none(), max_seq_len=64, max_batch=1)
    pl = place(CFG, torch.float32, BIG, max_seq_len=64, max_batch=1, strategy="fraction", fraction=0.5)
    with pytest.raises(ValueError, match="needs a GPU budget"):
        FiddlerExecutor(CFG, experts, gpu=GpuSide.none(), dtype=torch.float32, placement=pl, planner="paper",
                        latency_model=LM_EVEN, threads=Threads.choose(GpuSide.none(), torch.float32, None, None))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_all_kinds_with_streams(dtype):
    experts = make_experts(dtype=dtype)
    lm = LatencyModel.manual(cpu=(1e-4, 1e-3), gpu=(1e-5, 1e-4), transfer=1e-2)
    ex = build_executor(CFG, experts, gpu=GpuSide.cuda(BIG), max_seq_len=256, max_batch=1,
                        placement="fraction:0.5", planner="paper", latency_model=lm)
    x, idx, w = routing(200, dtype=dtype, seed=5)
    idx[:120, 0] = 4  # copy expert 4 (paper rule: s > 101), the other non-resident ones run on the CPU
    idx[:120, 1] = torch.where(idx[:120, 1] == 4, 5, idx[:120, 1])
    got = ex.forward(0, x.cuda(), idx.cuda(), w.cuda()).cpu().float()
    torch.cuda.synchronize()
    ref = reference([ExpertWeights(e.w1.float(), e.w3.float(), e.w2.float()) for e in experts[0]],
                    x.float(), idx, w.float())
    tol = 1e-4 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * float(ref.abs().max()))
    st = ex.stats
    assert {GPU, COPY, CPU} <= set(st.layers[0].last_decisions)
    assert st.bytes_d2h_activations == st.tokens[CPU] * CFG.hidden_size * x.element_size()
    assert st.bytes_h2d_activations == st.bytes_d2h_activations
    check_stats(ex, idx.numel())


def test_take_ownership_releases_host_copies():
    experts = make_experts(dtype=torch.bfloat16)
    keep = [[ExpertWeights(e.w1.clone(), e.w3.clone(), e.w2.clone()) for e in layer] for layer in experts]
    ex = build_executor(CFG, experts, gpu=GpuSide.none(), max_seq_len=64, max_batch=1,
                        take_ownership=True)
    assert all(e is None for layer in experts for e in layer)
    if ex.kernel is not None:  # without a GPU the packed copies are all that is kept
        assert all(h is None for layer in ex.host for h in layer) and ex.info()["packed_experts"] == 16
    x, idx, w = routing(6, dtype=torch.bfloat16, seed=3)
    ref = reference([ExpertWeights(e.w1.float(), e.w3.float(), e.w2.float()) for e in keep[0]], x.float(), idx,
                    w.float())
    torch.testing.assert_close(ex.forward(0, x, idx, w).float(), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))
