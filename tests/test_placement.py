"""Placement under a GPU budget: reservation, popularity/random/fraction/mask strategies, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fiddler.config import MoEConfig
from fiddler.placement import (COPY_BUFFERS, activation_bytes, dense_placement, layer_dense_bytes, parse_placement,
                               place, reservation)
from fiddler.popularity import Popularity

REF = Path(__file__).resolve().parents[1] / "results/reference/mixtral-8x7b/expert-popularity"
MIXTRAL = MoEConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, num_experts=8, top_k=2, num_heads=32,
                    num_kv_heads=8, head_dim=128, vocab_size=32000)
TINY = MoEConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_experts=8, top_k=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, vocab_size=512)
BF16 = torch.bfloat16


def test_reservation_components():
    r = reservation(MIXTRAL, BF16, max_seq_len=512, max_batch=1)
    assert r["non_expert_weights"] == MIXTRAL.non_expert_bytes(BF16)
    assert r["kv_cache"] == MIXTRAL.kv_cache_bytes(512, 1, BF16) == 2 * 32 * 8 * 512 * 128 * 2
    assert r["expert_copy_buffers"] == COPY_BUFFERS * 3 * 4096 * 14336 * 2
    assert r["activations"] == sum(activation_bytes(MIXTRAL, BF16, 512, 1).values())
    # activations grow with the number of tokens in flight, and stay far below the weights for short prompts
    r2 = reservation(MIXTRAL, BF16, max_seq_len=2048, max_batch=4)
    assert r2["activations"] > 4 * r["activations"] and r2["kv_cache"] == 16 * r["kv_cache"]
    assert r["activations"] < r["expert_copy_buffers"]


def test_budget_below_reservation_moves_dense_layers_to_cpu_then_raises_with_numbers():
    need = sum(reservation(MIXTRAL, BF16, 512, 1).values())
    pl = place(MIXTRAL, BF16, need, max_seq_len=512, max_batch=1)
    assert pl.num_resident == 0 and pl.gpu_bytes == need and pl.gpu_layers is None
    assert pl.to_dict()["dense_cpu_layers"] == []
    # one byte short: the first layer's dense part (and its KV cache) goes to the CPU, like llama.cpp -ngl 31
    pl = place(MIXTRAL, BF16, need - 1, max_seq_len=512, max_batch=1)
    assert pl.to_dict()["dense_cpu_layers"] == [0] and pl.gpu_bytes <= need - 1
    per_layer = layer_dense_bytes(MIXTRAL, BF16, 512, 1)
    assert pl.gpu_bytes == need - per_layer[0]
    # below the part that always stays on the GPU (embeddings/lm_head, copy buffers, activations): an error
    fixed = sum(reservation(MIXTRAL, BF16, 512, 1, gpu_layers=[False] * 32).values())
    with pytest.raises(ValueError, match=rf"GPU budget {fixed - 1} B .*every layer's dense part on the CPU: {fixed} B"):
        place(MIXTRAL, BF16, fixed - 1, max_seq_len=512, max_batch=1)
    assert place(MIXTRAL, BF16, fixed, max_seq_len=512, max_batch=1).gpu_layers == (False,) * 32


def test_dense_placement_keeps_the_last_layers_like_ngl():
    per_layer = layer_dense_bytes(MIXTRAL, BF16, 512, 1)
    fixed = sum(reservation(MIXTRAL, BF16, 512, 1, gpu_layers=[False] * 32).values())
    dp = dense_placement(MIXTRAL, BF16, fixed + 5 * per_layer[0] + 7, max_seq_len=512, max_batch=1)
    assert dp.gpu_layers == (False,) * 27 + (True,) * 5 and dp.cpu_layers == list(range(27))
    assert dense_placement(MIXTRAL, BF16, None, max_seq_len=512, max_batch=1).all_on_gpu


@pytest.mark.parametrize("gib", [12, 24, 48, 80])
def test_popularity_placement_fills_budget_with_most_popular(gib):
    budget = gib << 30
    pop = Popularity.load(REF / "original/college_computer_science.json")
    pl = place(MIXTRAL, BF16, budget, max_seq_len=512, max_batch=1, popularity=pop)
    eb = MIXTRAL.expert_bytes(BF16)
    need = sum(pl.reserved.values())
    assert pl.num_resident == min(256, (budget - need) // eb)
    assert pl.gpu_bytes <= budget and budget - pl.gpu_bytes < eb or pl.num_resident == 256
    # every resident expert is at least as popular as every non-resident one
    sh = pop.shares()
    res = [sh[l][e] for l in range(32) for e in range(8) if pl.resident[l][e]]
    non = [sh[l][e] for l in range(32) for e in range(8) if not pl.resident[l][e]]
    if res and non:
        assert min(res) >= max(non)
    d = pl.to_dict()
    assert d["num_resident"] == pl.num_resident and sum(d["resident_per_layer"]) == pl.num_resident


def test_random_placement_is_seeded():
    kw = dict(max_seq_len=512, max_batch=1, strategy="random")
    budget = 30 << 30
    a, b, c = (place(MIXTRAL, BF16, budget, seed=s, **kw) for s in (1, 1, 2))
    assert a.resident == b.resident and a.resident != c.resident
    assert a.num_resident == place(MIXTRAL, BF16, budget, max_seq_len=512, max_batch=1).num_resident


@pytest.mark.parametrize("fraction,expected", [(0.0, 0), (0.5, 8), (1.0, 16)])
def test_fraction_placement(fraction, expected):
    pl = place(TINY, torch.float32, 1 << 30, max_seq_len=64, max_batch=1, strategy="fraction", fraction=fraction)
    assert pl.num_resident == expected
    if fraction == 0.5:  # uniform popularity: half of every layer
        assert [sum(r) for r in pl.resident] == [4, 4]


def test_mask_placement_and_over_budget_errors():
    mask = [[True, False] * 4, [False] * 8]
    pl = place(TINY, torch.float32, 1 << 30, max_seq_len=64, max_batch=1, strategy="mask", mask=mask)
    assert pl.resident == mask
    need = sum(reservation(TINY, torch.float32, 64, 1).values())
    eb = TINY.expert_bytes(torch.float32)
    with pytest.raises(ValueError, match="wants 4 resident experts.*room for 3"):
        place(TINY, torch.float32, need + 3 * eb + 1, max_seq_len=64, max_batch=1, strategy="mask", mask=mask)
    with pytest.raises(ValueError, match="2 x 8"):
        place(TINY, torch.float32, 1 << 30, max_seq_len=64, max_batch=1, strategy="mask", mask=[[True]])
    with pytest.raises(ValueError, match="unknown placement"):
        place(TINY, torch.float32, 1 << 30, max_seq_len=64, max_batch=1, strategy="lru")


def test_no_gpu_means_nothing_resident():
    pl = place(MIXTRAL, BF16, None, max_seq_len=512, max_batch=1)
    assert pl.num_resident == 0 and pl.budget_bytes is None


def test_parse_placement():
    assert parse_placement("popularity") == ("popularity", {})
    assert parse_placement("fraction:0.25") == ("fraction", {"fraction": 0.25})
    assert parse_placement("all") == ("fraction", {"fraction": 1.0})
    assert parse_placement("none") == ("fraction", {"fraction": 0.0})
    for bad in ("fraction:x", "lru", ""):
        with pytest.raises(ValueError):
            parse_placement(bad)
