"""Bounded rows on the GPU side (issue 51, long prompts): an expert's rows run EXPERT_ROW_CHUNK at a time, so the
placement reserves one chunk's intermediates instead of a whole long prompt's, exactly as before in fp32."""
from __future__ import annotations

import pytest
import torch

import fiddler.executors.orchestrator as orchestrator
from fiddler import Engine
from fiddler.config import MoEConfig
from fiddler.executors import FiddlerPolicy, GpuSide
from fiddler.placement import EXPERT_ROW_CHUNK, activation_bytes, dense_placement, row_chunks
from tests.models import ARCHS, MIX_LATENCY, model_path, prompt

MIXTRAL = MoEConfig.from_dict(dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                   num_local_experts=8, num_experts_per_tok=2, vocab_size=32000))


def test_the_reservation_holds_one_chunk_of_an_experts_rows():
    """e8k2's shape (H 64, F 128, top-2, 4 heads of 16, 2 KV heads), fp32, 60 rows of 100 positions (T = 6000)."""
    cfg = MoEConfig.from_dict({"model_type": "mixtral", **ARCHS["e8k2"]})
    assert EXPERT_ROW_CHUNK == 4096
    act = activation_bytes(cfg, torch.float32, 100, 60)
    assert act["residual"] == 2 * 6000 * 64 * 4 == 3_072_000
    moe = (2 * 6000 * 2 * 64 * 4  # per-slot outputs and CPU results: 6,144,000
           + 6000 * 64 * 4  # combined output: 1,536,000
           + 4096 * (2 * 64 + 4 * 128) * 4  # one chunk of 4096 rows (not 6000): 10,485,760
           + 3 * 6000 * 2 * 8)  # indices: 288,000
    assert moe == 18_453_760
    attention = 6000 * (2 * 4 + 2 * 2) * 16 * 4 + 60 * 100 * 100  # 4,608,000 + the mask's 600,000
    assert act["attention_or_moe"] == max(moe, attention) == moe
    # up to a chunk's rows nothing changes: all rows are one chunk
    small = activation_bytes(cfg, torch.float32, 100, 40)
    assert small["attention_or_moe"] == 2 * 4000 * 2 * 64 * 4 + 4000 * 64 * 4 + 4000 * 640 * 4 + 3 * 4000 * 2 * 8
    assert [len(row_chunks(n)) for n in (0, 1, 4096, 4097, 12288, 12289)] == [1, 1, 1, 2, 3, 4]
    assert row_chunks(4097) == [(0, 2049), (2049, 4097)]  # equal halves, not 4096 rows and a sliver of 1
    assert row_chunks(10, 4) == [(0, 4), (4, 7), (7, 10)]


def test_mixtral_keeps_every_layer_on_a_12_gib_card_at_32k_tokens():
    """The RTX 3060 of the long-prefill experiment (budget 12 GiB): one expert's intermediates for all 32K tokens
    (4 GiB) pushed 9 layers' dense parts onto the CPU; a chunk's 0.5 GiB leaves them all on the GPU."""
    act = activation_bytes(MIXTRAL, torch.bfloat16, 32769, 1)
    assert act["attention_or_moe"] < 2 * 2**30
    assert all(dense_placement(MIXTRAL, torch.bfloat16, 12 * 2**30, max_seq_len=32769, max_batch=1).gpu_layers)


def _engine(placement: str) -> Engine:
    return Engine.from_pretrained(model_path("e8k2"), dtype=torch.float32, max_batch=1, max_seq_len=256,
                                  gpu=GpuSide.emulated(1 << 40),
                                  executor=FiddlerPolicy(placement=placement, latency_model=MIX_LATENCY))


@pytest.mark.parametrize("placement", ["none", "fraction:0.5", "all"])
def test_chunked_rows_equal_unchunked_in_fp32(placement, monkeypatch):
    """A 240-token prefill (about 60 rows an expert) and greedy decode with chunks of at most 32 rows against one
    chunk per expert: bit-equal logits and tokens at 0 / 50 / 100% resident. (Chunks of a few rows would not be:
    a GEMM of 1-3 rows, or of a few rows a thread, takes other kernels; row_chunks makes chunks equal, and the
    engine's are thousands of rows.)"""
    calls = []
    real = orchestrator.torch_expert

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(orchestrator, "torch_expert", counted)
    ids = prompt(240, ARCHS["e8k2"]["vocab_size"], seed=9)
    whole = _engine(placement)
    want_logits, want = whole.forward_logits(ids), whole.generate(ids, max_new_tokens=5).tokens
    unchunked_calls = len(calls)
    monkeypatch.setattr(orchestrator, "EXPERT_ROW_CHUNK", 32)
    chunked = _engine(placement)
    calls.clear()
    got_logits, got = chunked.forward_logits(ids), chunked.generate(ids, max_new_tokens=5).tokens
    assert len(calls) > unchunked_calls  # the rows really went in chunks
    assert torch.equal(got_logits, want_logits) and torch.equal(got, want)


def test_the_simulator_charges_a_read_of_the_weights_per_chunk():
    from fiddler.latency import HardwareSpec
    from fiddler.sim import Efficiency, SimHardware
    from fiddler.sim.fiddler_policy import _expert_on_gpu

    hw = SimHardware.build(HardwareSpec(1008, 165, 25, 83.2, 16, "avx512_bf16", 25), Efficiency.for_classes("amd_zen"),
                           measured_limit=False)
    eb, fpt = 3e8, 3.5e8
    assert _expert_on_gpu(hw, eb, fpt, EXPERT_ROW_CHUNK) == hw.gpu(eb, fpt * EXPERT_ROW_CHUNK)
    assert _expert_on_gpu(hw, eb, fpt, 3 * EXPERT_ROW_CHUNK + 1) == hw.gpu(4 * eb, fpt * (3 * EXPERT_ROW_CHUNK + 1), 4)
