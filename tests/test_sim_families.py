"""The simulator on the other families: shared-expert slots routed for every token, dense layers, MLA's
KV cache, and DeepSeek-V3 on a 12 GB card with the dense parts of the first layers on the CPU."""
from __future__ import annotations

import numpy as np
import torch

from systems.llama_cpp.sim import LlamaCppSimPolicy
from fiddler.latency import HardwareSpec
from fiddler.popularity import Popularity
from fiddler.sim import Efficiency, FiddlerSimPolicy, ProfileRouting, SimContext, SimHardware, simulate
from runners.simulate import model_config
from tests.test_families import conf

RTX3060 = HardwareSpec(360, 25, 25, 51.2, 6, "avx2", 25)


def _ctx(cfg, budget_gb: float):
    hw = SimHardware.build(RTX3060, Efficiency.for_classes("avx2_desktop"), measured_limit=False)
    return SimContext(cfg, torch.bfloat16, hw, int(budget_gb * 2**30), max_seq_len=64, max_batch=1)


def _routing(cfg, seed=0):
    return ProfileRouting(Popularity.for_config(cfg), seed=seed, always=cfg.shared_slots)


def test_profile_routing_runs_every_shared_slot_for_every_token():
    cfg = conf("deepseek_v3")
    steps = list(_routing(cfg).steps(8, 3, 1))
    assert steps[0].ids.shape == (58, 8, 9)
    for s in steps:
        assert (s.ids == cfg.num_experts).any(axis=-1).all()  # the shared slot (id 256) in every row
        assert (np.sort(s.ids, axis=-1)[..., :-1] != np.sort(s.ids, axis=-1)[..., 1:]).all()  # distinct


def test_model_config_reads_the_family_from_arch():
    cfg = conf("qwen3_30b_a3b")
    assert model_config({"model_type": "qwen3_moe", **{k: v for k, v in _arch("qwen3_30b_a3b").items()}}) == cfg


def _arch(name):
    from omegaconf import OmegaConf

    from runners.models import CONF_MODEL

    return OmegaConf.to_container(OmegaConf.load(CONF_MODEL / f"{name}.yaml"))["arch"]


def test_deepseek_v3_on_12gb_puts_dense_parts_on_the_cpu_and_runs():
    cfg = conf("deepseek_v3")
    ctx = _ctx(cfg, 12)
    pol = FiddlerSimPolicy()
    pol.setup(ctx)
    pl = pol.placement.to_dict()
    assert pl["dense_cpu_layers"] and pl["dense_cpu_layers"] == list(range(len(pl["dense_cpu_layers"])))
    assert pl["dense_cpu_layers"][-1] < cfg.num_layers - 1
    r = simulate(pol, ctx, _routing(cfg), 16, 4)
    assert r.ttft_s > 0 and r.decode_s > 0
    # layers on the CPU move the residual stream across PCIe: activations crossed both ways
    st = r.stats
    assert st["bytes_d2h_activations"] > 0 and st["bytes_h2d_activations"] > 0
    # llama.cpp under the same budget: -ngl keeps the last whole layers that fit; one V3 layer with its 257
    # expert slots is 11.3 GB, so on 12 GB (less llama.cpp's allowance) none does, and it runs on the CPU
    lp = LlamaCppSimPolicy(n_gpu_layers=None, n_cpu_moe=0, quant="bf16", n_batch=512, n_ctx=None, kv_cache_type="f16")
    lp.setup(ctx)
    assert cfg.expert_slots * cfg.expert_bytes() > 11 * 2**30 and lp.gpu_attn == 0
    assert simulate(lp, ctx, _routing(cfg), 16, 4).decode_s > r.decode_s


def test_more_gpu_memory_moves_dense_layers_back_and_is_faster():
    cfg = conf("deepseek_v3")
    out = {}
    for gb in (12, 40):
        ctx = _ctx(cfg, gb)
        pol = FiddlerSimPolicy()
        pol.setup(ctx)
        out[gb] = (len(pol.placement.to_dict()["dense_cpu_layers"]), simulate(pol, ctx, _routing(cfg), 16, 4).decode_s)
    assert out[40][0] == 0 < out[12][0]
    assert out[40][1] < out[12][1]


def test_qwen3_30b_a3b_simulates_with_128_experts_top_8():
    cfg = conf("qwen3_30b_a3b")
    ctx = _ctx(cfg, 12)
    pol = FiddlerSimPolicy()
    pol.setup(ctx)
    assert pol.placement.gpu_layers is None  # 3 GB of dense weights fit
    r = simulate(pol, ctx, _routing(cfg), 16, 4)
    assert r.stats["routed_tokens"] == 48 * 8 * (16 + 3)
