"""Popularity profiles: the published JSON format, per-layer normalisation, shape checks, recording."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fiddler.config import MoEConfig
from fiddler.popularity import Popularity, PopularityRecorder

REF = Path(__file__).resolve().parents[1] / "results/reference/mixtral-8x7b/expert-popularity"


def _cfg(layers=2, experts=4, top_k=2):
    return MoEConfig(hidden_size=32, intermediate_size=64, num_layers=layers, num_experts=experts, top_k=top_k,
                     num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=64)


@pytest.mark.parametrize("variant", ["original", "instruct"])
def test_reference_profiles_load_and_normalise(variant):
    files = sorted((REF / variant).glob("*.json"))
    assert len(files) == 7
    for f in files:
        raw = json.loads(f.read_text())
        p = Popularity.load(f)
        assert p.shape == (32, 8) and p.top_k == 2
        assert p.total_input_tokens == raw["total_input_tokens"]
        for layer, row in zip(p.shares(), raw["expert_popularity"]):
            assert sum(layer) == pytest.approx(2.0)
            assert layer == pytest.approx([c / sum(row) * 2 for c in row])
        # the README's note: counts per layer are 2.7-3.3 x the word count
        ratios = [sum(r) / raw["total_input_tokens"] for r in raw["expert_popularity"]]
        assert 2.5 < min(ratios) and max(ratios) < 3.5


def test_ranking_orders_by_share_and_is_deterministic():
    p = Popularity([[1, 5, 3], [4, 4, 0]], top_k=1)
    # shares: layer 0 -> 1/9, 5/9, 3/9; layer 1 -> .5, .5, 0
    assert p.ranking() == [(0, 1), (1, 0), (1, 1), (0, 2), (0, 0), (1, 2)]
    u = Popularity.uniform(3, 2)
    assert u.ranking()[:3] == [(0, 0), (1, 0), (2, 0)]  # ties spread over layers


def test_shape_check_names_both_shapes():
    p = Popularity.uniform(32, 8)
    with pytest.raises(ValueError, match=r"32 layers x 8 experts.*2 layers x 4 experts"):
        p.check_shape(_cfg())
    p.check_shape(_cfg(32, 8))
    with pytest.raises(ValueError, match="32 layers x 8 experts"):
        Popularity.for_config(_cfg(), REF / "original/machine_learning.json")


def test_invalid_profiles_rejected():
    with pytest.raises(ValueError, match="ragged"):
        Popularity([[1, 2], [1]])
    with pytest.raises(ValueError, match="non-negative"):
        Popularity([[1, -2]])
    with pytest.raises(ValueError, match="expert_popularity"):
        Popularity.from_dict({"counts": [[1]]})


def test_empty_layer_is_uniform_and_uniform_default():
    p = Popularity([[0, 0, 0, 0], [1, 0, 0, 3]], top_k=2)
    assert p.shares()[0] == [0.5] * 4
    assert p.shares()[1] == [0.5, 0, 0, 1.5]
    cfg = _cfg()
    u = Popularity.for_config(cfg, None)
    assert u.shape == (2, 4) and u.shares() == [[0.5] * 4] * 2


def test_save_load_roundtrip(tmp_path):
    p = Popularity([[3, 1, 0, 2], [1, 1, 1, 1]], top_k=2, total_input_tokens=3, meta={"source": "unit"})
    f = tmp_path / "sub/p.json"
    p.save(f)
    d = json.loads(f.read_text())
    assert d["expert_popularity"] == [[3, 1, 0, 2], [1, 1, 1, 1]] and d["total_input_tokens"] == 3
    q = Popularity.load(f)
    assert q.counts == p.counts and q.top_k == 2 and q.meta["source"] == "unit"


def test_recorder_counts_routing():
    cfg = _cfg(layers=2, experts=4, top_k=2)
    rec = PopularityRecorder.for_config(cfg)
    g = torch.Generator().manual_seed(0)
    expected = torch.zeros(2, 4, dtype=torch.int64)
    for T in (5, 1, 1, 7):
        for layer in range(2):
            idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])
            rec.record(layer, idx)
            expected[layer] += torch.bincount(idx.flatten(), minlength=4)
    pop = rec.popularity(source="test")
    assert pop.counts == expected.tolist()
    assert pop.total_input_tokens == 14 and rec.tokens == 14
    assert all(sum(r) == 28 for r in pop.counts)
    with pytest.raises(ValueError, match="out of range"):
        rec.record(0, torch.tensor([[0, 4]]))
    rec.reset()
    assert rec.tokens == 0 and rec.popularity().counts == [[0] * 4] * 2


def test_profile_script_on_tiny_checkpoint(tmp_path):
    import importlib.util

    from tests.models import ARCHS, model_path

    spec = importlib.util.spec_from_file_location("profile_popularity", Path(__file__).resolve().parents[1]
                                                  / "scripts/profile_popularity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    arch = ARCHS["e8k2"]
    out = tmp_path / "pop.json"
    assert mod.main(["--model", str(model_path("e8k2")), "--synthetic", "3", "--prompt-len", "10",
                     "--max-new-tokens", "2", "--dtype", "float32", "--out", str(out)]) == 0
    p = Popularity.load(out)
    assert p.shape == (arch["num_hidden_layers"], arch["num_local_experts"]) and p.top_k == 2
    assert p.total_input_tokens == 30
    # prefill routes 10 tokens per prompt, then 2 generated tokens: 1 more forward of 1 token
    # (the first new token comes from the prefill logits)
    routed = p.meta["routed_tokens"]
    assert routed == 3 * (10 + 1)
    assert all(sum(row) == routed * 2 for row in p.counts)
    assert p.meta["source"]["tool"] == "scripts/profile_popularity.py"
    # the profile feeds placement directly
    from fiddler.config import MoEConfig

    Popularity.for_config(MoEConfig.from_pretrained(model_path("e8k2")), out)


def test_the_placement_popularity_rule():
    """One rule for the profile Fiddler places by (execute, serve and simulate all call it): the system's
    popularity_profile where given, else the model's reference profile, else None (uniform)."""
    from systems.fiddler.profiles import placement_popularity, reference_popularity

    assert placement_popularity("my.json", "mixtral_8x7b") == "my.json"
    assert placement_popularity(None, "mixtral_8x7b") is reference_popularity("mixtral_8x7b") is not None
    assert placement_popularity(None, "tiny_mixtral") is None
