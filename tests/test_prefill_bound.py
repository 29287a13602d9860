"""The streaming bound of a long prefill (fiddler.sim.bounds), on a case computed by hand, and in records."""
from __future__ import annotations

import pytest
import torch

from fiddler.config import MoEConfig
from fiddler.latency import HardwareSpec
from fiddler.sim import Efficiency, SimContext, SimHardware
from fiddler.sim.bounds import prefill_flops, prefill_streaming_bound

# hidden 64, ffn 128, 2 layers of 4 experts top-2, 4 heads of 16 (2 KV heads), vocab 100
TINY = MoEConfig.from_dict(dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                num_experts_per_tok=2, vocab_size=100))
# GPU 1000 GB/s and 100 TFLOP/s, PCIe 10 GB/s
SPEC = HardwareSpec(1000, 100, 10, 100, 8, "avx2", 8)


def ctx() -> SimContext:
    hw = SimHardware.build(SPEC, Efficiency.for_classes("amd_zen"), measured_limit=False)
    return SimContext(TINY, torch.bfloat16, hw, 1 << 30, max_seq_len=512, max_batch=1)


def test_the_bound_by_hand():
    c = ctx()
    T, resident = 100, 3
    # PCIe: 8 experts less 3 resident, each 3 x 64 x 128 bf16 values
    streamed_bytes = 5 * 3 * 64 * 128 * 2
    pcie_s = streamed_bytes / (10e9 * c.hw.spec.pcie_eff)
    # FLOPs per layer: 2 x T x the layer's weights (q 64x64, k and v 64x32 each, o 64x64, two norms of 64, the
    # router 64x4) + causal attention (T(T+1)/2 query-key pairs, 4 heads, q.k and p.v of 16 each, 2 FLOPs
    # per multiply-add) + T x 2 slots x 2 x the expert's 3 x 64 x 128 weights; then the lm_head of the last
    # token (64 x 100) and the final norm (64)
    layer_weights = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64 + 64 * 4
    per_layer = 2 * T * layer_weights + 2 * (T * (T + 1) / 2) * 4 * (16 + 16) + T * 2 * 2 * (3 * 64 * 128)
    flops = 2 * per_layer + 2 * (64 * 100 + 64)
    assert prefill_flops(c, T) == pytest.approx(flops)
    gpu_s = flops / (100e12 * c.hw.spec.gpu_flops_eff)
    b = prefill_streaming_bound(c, resident, T)
    assert b["pcie_s"] == pytest.approx(pcie_s)
    assert b["gpu_s"] == pytest.approx(gpu_s)
    assert b["bound_s"] == pytest.approx(max(pcie_s, gpu_s))
    assert b["binds"] == ("pcie" if pcie_s >= gpu_s else "gpu")
    assert b["streamed_experts"] == 5 and b["streamed_bytes"] == streamed_bytes


def test_more_resident_experts_lower_the_copy_term_only():
    c = ctx()
    few, many = prefill_streaming_bound(c, 0, 64), prefill_streaming_bound(c, 8, 64)
    assert many["pcie_s"] == 0 < few["pcie_s"] and many["gpu_s"] == few["gpu_s"]


def test_no_gpu_no_bound():
    hw = SimHardware.build(SPEC, Efficiency.for_classes("amd_zen"), measured_limit=False)
    with pytest.raises(ValueError, match="GPU"):
        prefill_streaming_bound(SimContext(TINY, torch.bfloat16, hw, None, max_seq_len=64, max_batch=1), 0, 8)
