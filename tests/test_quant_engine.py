"""Quantized experts in the engine (fiddler.quant): quantize at load, the on-disk cache, GGUF input (the
same bytes as llama.cpp's pure quantization), every executor path incl. the emulated GPU side (kinds a
and b hold and copy block bytes), byte counts, and the harness options."""
from __future__ import annotations

import pytest
import torch

import fiddler.kernels as fk
from fiddler import Engine
from fiddler import quant as fquant
from fiddler.config import MoEConfig
from fiddler.executors import FiddlerPolicy, local_executor
from fiddler.gpu_side import GpuSide
from fiddler.placement import place
from fiddler.step import rows
from fiddler.weights import load_weights
from tests.models import model_path, prompt

pytestmark = pytest.mark.skipif(not fk.is_available(), reason=f"kernel library not built: {fk.load_error()}")


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_quantized_engine_matches_dequantized_weights(quant, tmp_path):
    """fp32 engine on dequantized block weights vs the quantized engine in w mode (fp32 activations): the
    only differences are bf16 roundings of activations."""
    path = model_path("e16k4_odd")
    fk.quant.set_mode("w")
    e = Engine.from_pretrained(path, quant=quant, quant_cache=tmp_path, executor=local_executor)
    ids = prompt(24, 500)
    lq = e.forward_logits(ids)
    # reference: fp32 transformers-equivalent engine with every quantized weight replaced by its dequantized value
    cfg = MoEConfig.from_pretrained(path)
    ref = Engine.from_pretrained(path, dtype=torch.float32, executor=local_executor)
    w = load_weights(path, cfg)
    blocks: dict = {}
    fquant.quantize_experts(w.experts, quant, blocks)
    attn = fquant.quantize_attention(w, quant, blocks)
    H, F_ = cfg.hidden_size, cfg.intermediate_size
    for l, layer in enumerate(ref.executor.experts):
        for i, ex in enumerate(layer):
            d = fquant.dequantize_expert(w.experts[l][i], quant, H, F_, torch.float32)
            ex.w1.copy_(d.w1), ex.w3.copy_(d.w3), ex.w2.copy_(d.w2)
    nh, d_ = cfg.num_heads, cfg.head_dim
    for layer, a in zip(ref.model.layers, attn):
        layer.qkv_proj.weight.copy_(fquant.dequantize_blocks(a["qkv"], quant, H, torch.float32))
        layer.o_proj.weight.copy_(fquant.dequantize_blocks(a["o"], quant, nh * d_, torch.float32))
    lr = ref.forward_logits(ids)
    fk.quant.set_mode("auto")
    err = ((lq - lr).norm() / lr.norm()).item()
    # the yardstick: the bf16 engine against fp32 on the original weights (bf16 activation roundings only)
    lb = Engine.from_pretrained(path, executor=local_executor).forward_logits(ids)
    l32 = Engine.from_pretrained(path, dtype=torch.float32, executor=local_executor).forward_logits(ids)
    base = ((lb - l32).norm() / l32.norm()).item()
    assert err < 1.5 * base + 5e-3, (err, base)


def test_cache_is_keyed_by_checkpoint_and_type_and_reused(tmp_path):
    path = model_path("e8k2")
    e1 = Engine.from_pretrained(path, quant="q4_0", quant_cache=tmp_path)
    assert e1.info()["quant_info"]["source"] == "quantized at load"
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and "-q4_0-" in files[0]
    e2 = Engine.from_pretrained(path, quant="q4_0", quant_cache=tmp_path)
    assert e2.info()["quant_info"]["source"].startswith("cache:")
    ids = prompt(12, 512)
    assert torch.equal(e1.forward_logits(ids), e2.forward_logits(ids))
    Engine.from_pretrained(path, quant="q8_0", quant_cache=tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


def test_bad_quant_arguments():
    path = model_path("e8k2")
    with pytest.raises(ValueError, match="unknown quant type"):
        Engine.from_pretrained(path, quant="q5_k")
    with pytest.raises(ValueError, match="needs dtype=torch.bfloat16"):
        Engine.from_pretrained(path, quant="q8_0", dtype=torch.float32)
    with pytest.raises(ValueError, match="gguf= reads quantized tensors"):
        Engine.from_pretrained(path, gguf="x.gguf")


def _budget_with_experts(cfg, quant: str, n: int) -> int:
    """A GPU budget: the reserved dense part (max_seq_len 256, 4 rows) plus n quantized experts."""
    return sum(place(cfg, torch.bfloat16, 1 << 40, max_seq_len=256, max_batch=4, quant=quant)
               .reserved.values()) + n * cfg.expert_bytes(torch.bfloat16, quant)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_emulated_gpu_side_copies_block_bytes_and_matches_cpu(quant, tmp_path):
    """Kinds a (resident), b (copied in) and c (CPU) all run; b copies exactly the quantized bytes. In w
    mode the CPU kernel and the GPU side's dequantized torch compute agree to bf16 noise."""
    path = model_path("e8k2")
    cfg = MoEConfig.from_pretrained(path)
    fk.quant.set_mode("w")
    try:
        cpu = Engine.from_pretrained(path, quant=quant, quant_cache=tmp_path)
        budget = _budget_with_experts(cfg, quant, 5)
        gpu = Engine.from_pretrained(path, quant=quant, quant_cache=tmp_path, max_seq_len=256,
                                     gpu=GpuSide.emulated(budget), executor=FiddlerPolicy(placement="popularity"))
        ex = gpu.executor
        assert 0 < ex.placement.num_resident < cfg.num_layers * cfg.num_experts
        assert ex.expert_bytes == cfg.expert_bytes(torch.bfloat16, quant)
        assert all(t.dtype == torch.uint8 for b in ex.buffers for t in b)  # every buffer tensor holds bytes
        ids = prompt(20, 512)
        lc, lg = cpu.forward_logits(ids), gpu.forward_logits(ids)
        assert ((lc - lg).norm() / lc.norm()).item() < 3e-2
        st = ex.stats
        if st.weight_copies:
            assert st.bytes_h2d_weights == st.weight_copies * cfg.expert_bytes(torch.bfloat16, quant)
        out = gpu.generate(ids, max_new_tokens=4)
        assert out.tokens.shape[0] == 4
    finally:
        fk.quant.set_mode("auto")


def test_byte_counts():
    cfg = MoEConfig.from_pretrained(model_path("e8k2"))
    h, f = cfg.hidden_size, cfg.intermediate_size
    assert cfg.expert_bytes(torch.bfloat16, "q8_0") == 3 * h * f // 32 * 34
    assert cfg.expert_bytes(torch.bfloat16, "q4_0") == 3 * h * f // 32 * 18
    assert cfg.expert_bytes(torch.bfloat16, None) == 3 * h * f * 2
    bf, q4 = cfg.decode_bytes_per_token(16), cfg.decode_bytes_per_token(16, quant="q4_0")
    saved = (cfg.num_layers * (cfg.top_k * cfg.expert_params() + cfg.attention_params())) * (2 - 18 / 32)
    assert abs((bf - q4) - saved) < 1
    # placement: quantized experts are smaller, so more fit in the same budget
    b = sum(place(cfg, torch.bfloat16, 1 << 40, max_seq_len=64, max_batch=1).reserved.values())
    budget = b + 6 * cfg.expert_bytes(torch.bfloat16)
    n_bf = place(cfg, torch.bfloat16, budget, max_seq_len=64, max_batch=1, strategy="random").num_resident
    n_q = place(cfg, torch.bfloat16, budget, max_seq_len=64, max_batch=1, strategy="random", quant="q4_0").num_resident
    assert n_q > n_bf


@pytest.mark.llamacpp
@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_gguf_blocks_are_our_blocks(quant):
    """llama.cpp's pure quantization of the bf16 GGUF holds exactly the bytes the engine quantizes (after
    undoing the converter's q/k row permutation), and the engine runs from the GGUF file."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from systems.base import SystemUnavailable
    from systems.llama_cpp import convert
    from runners.models import synthetic_model

    tiny = synthetic_model("tiny_mixtral")
    try:
        g = convert.ensure_gguf(tiny, quant, convert._user_cache_root(), threads=2, pure=True)
    except SystemUnavailable as exc:
        pytest.skip(str(exc).splitlines()[0])
    cfg = MoEConfig.from_pretrained(tiny)
    from_gguf = fquant.load_gguf_blocks(g, cfg, quant)
    w = load_weights(tiny, cfg)
    ours: dict = {}
    fquant.quantize_experts(w.experts, quant, ours)
    fquant.quantize_attention(w, quant, ours)
    assert ours.keys() == from_gguf.keys()
    assert all(torch.equal(ours[k], from_gguf[k]) for k in ours)
    e = Engine.from_pretrained(tiny, quant=quant, gguf=g)
    assert e.info()["quant_info"]["source"] == f"gguf:{g}"
    # a GGUF of another type is refused with the reason
    other = convert.ensure_gguf(tiny, "q8_0" if quant == "q4_0" else "q4_0", convert._user_cache_root(), threads=2,
                                pure=True)
    with pytest.raises(ValueError, match="pure"):
        fquant.load_gguf_blocks(other, cfg, quant)


def test_harness_options():
    from systems.fiddler.config import FiddlerConfig
    from systems.llama_cpp.config import LlamaCppConfig

    assert FiddlerConfig.build(quant="q4_0").quant == "q4_0"
    with pytest.raises(ValueError):
        FiddlerConfig.build(quant="q4_k_m")
    c = LlamaCppConfig.build(quant="q4_0")
    assert c.quant_policy.value == "pure"
    assert LlamaCppConfig.build(quant="q4_0", quant_policy="llama").quant_policy.value == "llama"


def test_simulator_counts_quantized_bytes():
    """mode=simulate with system.quant: the cost model, placement and latency model use the block bytes;
    on the same budget more experts are resident and decode is faster (Mixtral-8x7B on an RTX 4090 spec)."""
    from systems.fiddler.profiles import reference_popularity
    from fiddler.latency import HardwareSpec
    from fiddler.sim import Efficiency, FiddlerSimPolicy, ModelCosts, ProfileRouting, SimContext, SimHardware, simulate

    cfg = MoEConfig.from_dict(dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                   num_local_experts=8, num_experts_per_tok=2, vocab_size=32000))
    c16, c4 = ModelCosts(cfg, torch.bfloat16), ModelCosts(cfg, torch.bfloat16, "q4_0")
    assert c4.expert_bytes == cfg.expert_bytes(torch.bfloat16, "q4_0") < c16.expert_bytes
    assert c4.head_bytes == c16.head_bytes and c4.layer_bytes < c16.layer_bytes
    hw = SimHardware.build(HardwareSpec(1008, 165, 25, 83.2, 16, "avx512_bf16", 25), Efficiency.for_classes("amd_zen"),
                           measured_limit=False)
    pop = reference_popularity("mixtral_8x7b")
    res = {}
    for q in (None, "q4_0"):
        pol = FiddlerSimPolicy(quant=q)
        ctx = SimContext(cfg, torch.bfloat16, hw, 24 << 30, max_seq_len=96, max_batch=1, popularity=pop,
                         quant=pol.weight_quant)
        pol.setup(ctx)
        r = simulate(pol, ctx, ProfileRouting(pop, seed=0), 32, 16)
        res[q] = (pol.placement.num_resident, r)
    assert res["q4_0"][0] > 3 * res[None][0]
    assert res["q4_0"][1].decode_s < res[None][1].decode_s


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_cuda_gpu_side_dequantizes_block_bytes(quant, tmp_path):
    """On CUDA: resident and copied-in experts live on the GPU as block bytes (the copies move exactly
    the quantized bytes) and are dequantized there; logits agree with the CPU-only engine (w mode)."""
    path = model_path("e8k2")
    cfg = MoEConfig.from_pretrained(path)
    fk.quant.set_mode("w")
    try:
        cpu = Engine.from_pretrained(path, quant=quant, quant_cache=tmp_path, gpu=GpuSide.none())
        budget = _budget_with_experts(cfg, quant, 5)
        gpu = Engine.from_pretrained(path, quant=quant, quant_cache=tmp_path, max_seq_len=256,
                                     gpu=GpuSide.cuda(budget), executor=FiddlerPolicy(placement="popularity"))
        ex = gpu.executor
        assert 0 < ex.placement.num_resident < cfg.num_layers * cfg.num_experts
        assert all(t.dtype == torch.uint8 and t.is_cuda for b in ex.buffers for t in b)
        ids = prompt(20, 512)
        lc, lg = cpu.forward_logits(ids), gpu.forward_logits(ids).cpu()
        assert ((lc - lg).norm() / lc.norm()).item() < 3e-2
        st = ex.stats
        if st.weight_copies:
            assert st.bytes_h2d_weights == st.weight_copies * cfg.expert_bytes(torch.bfloat16, quant)
        assert gpu.generate(ids, max_new_tokens=4).tokens.shape[0] == 4
    finally:
        fk.quant.set_mode("auto")


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_quantized_gqa_families_stay_close_to_bf16(family, tmp_path):
    """Families with bias-free GQA attention (per-head or full-width q/k norms) quantize like Mixtral: Q8_0
    logits stay within Q8_0 noise of the bf16 engine's."""
    path = model_path(family)
    ids = prompt(16, 512)
    lb = Engine.from_pretrained(path, executor=local_executor).forward_logits(ids).float()
    e = Engine.from_pretrained(path, quant="q8_0", quant_cache=tmp_path, executor=local_executor)
    lq = e.forward_logits(ids).float()
    assert e.info()["quant"] == "q8_0"
    err = ((lq - lb).norm() / lb.norm()).item()
    assert 0 < err < 0.05, err


@pytest.mark.parametrize("family, feature", [("qwen2_moe", "biases"), ("deepseek_v2", "MLA")])
def test_quant_refuses_attention_it_does_not_implement(family, feature, tmp_path):
    from fiddler.config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=feature):
        Engine.from_pretrained(model_path(family), quant="q8_0", quant_cache=tmp_path)


def test_quantized_matmuls_get_fp32_activations_like_llama_cpp(tmp_path):
    """On the CPU the quantized engine feeds fp32 RMSNorm outputs (weight applied in fp32) to q/k/v and the
    experts, and routes in fp32; the fused decode step computes the same as the prefill path."""
    path = model_path("e8k2")
    e = Engine.from_pretrained(path, quant="q8_0", quant_cache=tmp_path)
    m = e.model
    assert e.info()["quant_fp32_activations"] and m.fp32_quant_acts
    assert all(l.router is None and l.router_fp32.dtype == torch.float32 for l in m.layers)
    seen = []
    qkv = m.layers[0].qkv_proj
    m.layers[0].qkv_proj = lambda x, **kw: (seen.append(x.dtype), qkv(x, **kw))[1]
    ids = prompt(12, 512)
    full = e.forward_logits(ids)
    m.forward(ids[:-1], rows(1, 0, 11))
    step = m.forward(ids[-1:], rows(1, 11)).clone()  # the fused decode step
    assert m.decode_fastpath and set(seen) == {torch.float32}
    assert ((step[0] - full[-1]).norm() / full[-1].norm()).item() < 2e-2
    assert m.decode_path()["why"] == "a projection outside the CPU kernel"  # the wrapper: layer by layer
    m.layers[0].qkv_proj = qkv  # the one-call layers (fk_decode_attn_block_q) compute the same step
    m.forward(ids[:-1], rows(1, 0, 11))
    block_step = m.forward(ids[-1:], rows(1, 11))
    assert m._block[1] is not None and m._block[1].fmt == "q8_0" and torch.equal(block_step, step)
    # the bf16 engine is untouched
    b = Engine.from_pretrained(path)
    assert not b.model.fp32_quant_acts and all(l.router is not None for l in b.model.layers)
