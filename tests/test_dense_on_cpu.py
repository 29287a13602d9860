"""Dense parts larger than the GPU budget: whole layers' attention, norms, router / dense MLP and KV cache
stay on the CPU (llama.cpp -ngl style) instead of failing, on the emulated GPU, and the engine still
computes transformers' function; shared experts are the first residents."""

from __future__ import annotations

import functools

import pytest
import torch

from fiddler import Engine
from fiddler.config import MoEConfig
from fiddler.executors import FiddlerPolicy, GpuSide
from fiddler.placement import layer_dense_bytes, reservation
from tests.models import ARCHS, MIX_LATENCY, hf_model, model_path, prompt

pytest.importorskip("transformers")

ARCH = "deepseek_v2"  # 3 layers: a dense first layer, then MoE layers with 2 shared-expert slots
SEQ, BATCH = 64, 4
_MIX = MIX_LATENCY


def _budget() -> tuple[int, MoEConfig]:
    cfg = MoEConfig.from_pretrained(model_path(ARCH))
    fixed = sum(reservation(cfg, torch.float32, SEQ, BATCH, gpu_layers=[False] * cfg.num_layers).values())
    per_layer = layer_dense_bytes(cfg, torch.float32, SEQ, BATCH)
    assert 3 * cfg.expert_bytes(torch.float32) < per_layer[1]  # room left for 3 experts, not another layer
    return fixed + per_layer[-1] + 3 * cfg.expert_bytes(torch.float32), cfg


@functools.cache
def engine() -> Engine:
    budget, _ = _budget()
    return Engine.from_pretrained(model_path(ARCH), dtype=torch.float32, gpu=GpuSide.emulated(budget),
                                  max_seq_len=SEQ, max_batch=BATCH,
                                  executor=FiddlerPolicy(placement="popularity", planner="makespan",
                                                         latency_model=_MIX))


def test_layers_that_do_not_fit_run_on_the_cpu_side():
    budget, cfg = _budget()
    info = engine().info()
    pl = info["executor_info"]["placement"]
    # the last layer's dense part fits, the first two do not
    assert info["dense_cpu_layers"] == pl["dense_cpu_layers"] == [0, 1]
    assert pl["reserved_bytes"]["non_expert_weights"] < cfg.non_expert_bytes(torch.float32)
    assert pl["reserved_bytes"]["kv_cache"] == cfg.kv_cache_bytes(SEQ, BATCH, torch.float32) // 3
    assert sum(pl["reserved_bytes"].values()) + pl["resident_bytes"] <= budget
    # what is left holds 3 experts: the shared-expert slots (every token runs them) come first
    assert pl["num_resident"] == 3
    shared = set(range(cfg.num_experts, cfg.expert_slots))
    resident = [(l, e) for l, row in enumerate(pl["resident"]) for e in row]
    assert all(e in shared for _, e in resident)
    # the model runs those layers with CPU-side weights and cache
    m = engine().model
    assert [str(d) for d in m.layer_devices] == ["cpu"] * 3  # emulated: the GPU side is the CPU device too


def test_fp32_greedy_and_beam_match_transformers_with_dense_parts_on_cpu():
    ref_model = hf_model(ARCH, torch.float32)
    ids = prompt(12, ARCHS[ARCH]["vocab_size"], seed=2)
    ref = ref_model.generate(ids[None], max_new_tokens=24, do_sample=False)[0, 12:]
    out = engine().generate(ids, max_new_tokens=24)
    assert out.tokens.tolist() == ref.tolist()
    assert set(k for k, n in out.stats["executor"]["tokens"].items() if n) == {"a", "b", "c"}
    ref = ref_model.generate(ids[None], max_new_tokens=12, num_beams=4, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    out = engine().generate(ids, max_new_tokens=12, beam_width=4)
    assert out.tokens.tolist() == ref.sequences[0, 12:].tolist()
    assert out.sequences_scores == pytest.approx(float(ref.sequences_scores[0]), abs=1e-4)


def test_below_the_fixed_part_fails_with_the_numbers():
    _, cfg = _budget()
    fixed = sum(reservation(cfg, torch.float32, SEQ, BATCH, gpu_layers=[False] * cfg.num_layers).values())
    with pytest.raises(ValueError, match="every layer's dense part on the CPU"):
        Engine.from_pretrained(model_path(ARCH), dtype=torch.float32, gpu=GpuSide.emulated(fixed - 1),
                               max_seq_len=SEQ, max_batch=BATCH, executor=FiddlerPolicy(latency_model=_MIX))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_greedy_with_dense_parts_on_cpu():
    """On a GPU the layers that do not fit run on the CPU device with their KV cache there; the residual
    stream moves between the devices and the results are still transformers'."""
    budget, cfg = _budget()
    e = Engine.from_pretrained(model_path(ARCH), dtype=torch.float32, gpu=GpuSide.cuda(budget),
                               max_seq_len=SEQ, max_batch=BATCH, executor=FiddlerPolicy(latency_model=_MIX))
    assert e.info()["dense_cpu_layers"] == [0, 1]
    assert [d.type for d in e.model.layer_devices] == ["cpu", "cpu", "cuda"]
    ids = prompt(12, ARCHS[ARCH]["vocab_size"], seed=2)
    ref = hf_model(ARCH, torch.float32).generate(ids[None], max_new_tokens=24, do_sample=False)[0, 12:]
    assert e.generate(ids, max_new_tokens=24).tokens.tolist() == ref.tolist()
    out = e.generate(ids, max_new_tokens=8, beam_width=4)
    assert len(out.tokens) == 8
