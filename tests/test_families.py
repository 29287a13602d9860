"""The model description of every supported family: the architecture-only configs' sizes against the
published parameter counts, byte counts per family (MLA's compressed KV cache, shared experts), and clear
errors for what the engine does not implement."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from fiddler.config import MoEConfig, UnsupportedModelError
from fiddler.popularity import Popularity
from runners.models import CONF_MODEL
from runners.synthetic import config_dict

BF16 = torch.bfloat16


def conf(name: str) -> MoEConfig:
    arch = OmegaConf.to_container(OmegaConf.load(CONF_MODEL / f"{name}.yaml"))["arch"]
    return MoEConfig.from_dict(config_dict(arch))


def params(c: MoEConfig, with_embedding: bool) -> tuple[float, float]:
    """(total, activated) parameters in billions: activated = what a decode step reads (plus the
    embedding table where the model card counts it)."""
    total = (c.non_expert_bytes(BF16) + c.all_expert_bytes(BF16)) / 2
    active = c.decode_bytes_per_token(0, BF16) / 2 + (c.vocab_size * c.hidden_size if with_embedding else 0)
    return total / 1e9, active / 1e9


# Published sizes (model cards: total / activated parameters in billions, and whether the activated count
# includes the embedding table: DeepSeek's do not). The engine's byte counts must reproduce them: they
# drive placement, the decode bound and the simulator. DeepSeek-V3's 671B is without its
# multi-token-prediction module (685B with it); Qwen's "3B"/"22B" active are 3.3B/22B.
PUBLISHED = {
    "mixtral_8x7b": (46.7, 12.9, True),
    "qwen3_30b_a3b": (30.5, 3.3, True),
    "qwen3_235b_a22b": (235.0, 22.0, True),
    "olmoe_1b_7b": (6.9, 1.3, True),
    "deepseek_v2_lite": (15.7, 2.4, False),
    "deepseek_v3": (671.0, 37.0, False),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_architecture_configs_reproduce_published_sizes(name):
    want_total, want_active, with_embedding = PUBLISHED[name]
    total, active = params(conf(name), with_embedding)
    assert total == pytest.approx(want_total, rel=0.01)
    assert active == pytest.approx(want_active, rel=0.03)


def test_dense_parts_exceed_the_cards_the_issue_names():
    # non-expert weights alone, without the shared experts (which are placeable expert slots)
    assert conf("qwen3_235b_a22b").non_expert_bytes(BF16) > 12 * 2**30
    v3 = conf("deepseek_v3")
    assert v3.non_expert_bytes(BF16) > 24 * 2**30
    shared = v3.num_moe_layers * v3.shared_slots * v3.expert_bytes(BF16)
    assert (v3.non_expert_bytes(BF16) + shared) / 2 / 1e9 == pytest.approx(17.1, rel=0.02)  # "about 17B"


def test_family_features_are_read_from_the_hf_config():
    q3 = conf("qwen3_30b_a3b")
    assert (q3.model_type, q3.num_experts, q3.top_k, q3.norm_topk_prob, q3.qk_norm, q3.shared_slots) == \
        ("qwen3_moe", 128, 8, True, "head", 0)
    assert q3.expert_bytes(BF16) == 3 * 2048 * 768 * 2 and q3.head_dim == 128
    q2 = conf("tiny_qwen2_moe")
    assert q2.qkv_bias and q2.shared_expert_gate and q2.shared_slots == 4 and not q2.norm_topk_prob
    assert q2.expert_slots == 20 and q2.active_slots == 8
    ol = conf("olmoe_1b_7b")
    assert ol.qk_norm == "full" and not ol.norm_topk_prob and ol.num_experts == 64
    v2 = conf("tiny_deepseek_v2")
    assert (v2.attention, v2.topk_method, v2.n_group, v2.topk_group, v2.q_lora_rank, v2.dense_layers) == \
        ("mla", "group_limited_greedy", 4, 2, 96, (0,))
    assert v2.rope_scaling["rope_type"] == "yarn" and v2.rope_style == "complex" and v2.shared_slots == 2
    v3 = conf("deepseek_v3")
    assert (v3.scoring_func, v3.topk_method, v3.norm_topk_prob, v3.routed_scaling_factor, v3.rope_style) == \
        ("sigmoid", "noaux_tc", True, 2.5, "interleave")
    assert v3.dense_layers == (0, 1, 2) and v3.num_moe_layers == 58 and v3.shared_slots == 1
    lite = conf("deepseek_v2_lite")
    assert lite.q_lora_rank is None and lite.topk_method == "greedy"


def test_mla_kv_cache_is_the_compressed_latent_plus_rope_key():
    v3 = conf("deepseek_v3")
    assert v3.kv_cache_bytes(1000, 2, BF16) == 61 * 2 * 1000 * (512 + 64) * 2
    q3 = conf("qwen3_30b_a3b")
    assert q3.kv_cache_bytes(1000, 1, BF16) == 48 * 1000 * 2 * 4 * 128 * 2


def test_decode_bytes_count_shared_experts_for_every_token():
    v2 = conf("deepseek_v2_lite")
    one = v2.decode_bytes_per_token(10, BF16)
    # two rows: routed experts double (capped), the shared ones are read once per step either way
    two = v2.decode_bytes_per_token(10, BF16, batch=2)
    eb = v2.expert_bytes(BF16) * v2.num_moe_layers
    kv = v2.kv_cache_bytes(10, 1, BF16)
    assert two - one == pytest.approx(6 * eb + kv)
    assert one == pytest.approx(v2.decode_bytes_per_token(10, BF16, experts_per_layer=6 + 2))


def test_uniform_popularity_ranks_shared_slots_first():
    v2 = conf("tiny_deepseek_v2")
    pop = Popularity.for_config(v2)
    assert pop.shape == (3, 18) and pop.top_k == 6
    first = pop.ranking()[: 2 * 3]
    assert {e for _, e in first} == {16, 17}
    assert pop.shares()[0][16] == pytest.approx(1.0) and pop.shares()[0][0] == pytest.approx(4 / 16)


@pytest.mark.parametrize("change,feature", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(use_sliding_window=True, sliding_window=128), "use_sliding_window"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}), "rope_type 'linear'"),
    (dict(model_type="dbrx", architectures=["DbrxForCausalLM"]), "unsupported model: model_type='dbrx'"),
])
def test_unsupported_features_fail_at_load_naming_them(change, feature):
    d = config_dict(OmegaConf.to_container(OmegaConf.load(CONF_MODEL / "tiny_qwen3_moe.yaml"))["arch"])
    d.update(change)
    with pytest.raises(UnsupportedModelError, match=feature):
        MoEConfig.from_dict(d)


def test_unsupported_deepseek_routing_fails_naming_it():
    d = config_dict(OmegaConf.to_container(OmegaConf.load(CONF_MODEL / "deepseek_v3.yaml"))["arch"])
    d["topk_method"] = "greedy"
    with pytest.raises(UnsupportedModelError, match="deepseek_v3: unsupported feature: topk_method='greedy'"):
        MoEConfig.from_dict(d)
    d = config_dict(OmegaConf.to_container(OmegaConf.load(CONF_MODEL / "tiny_deepseek_v2.yaml"))["arch"])
    d["attention_bias"] = True
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        MoEConfig.from_dict(d)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2", "deepseek_v2_lite",
                                  "deepseek_v3"])
def test_byte_counts_match_the_loaded_checkpoint(arch):
    """Parameter counts of every family equal what load_weights reads: non-expert tensors (attention incl.
    MLA's low-rank projections and norms, routers, shared-expert gates, dense MLPs, embeddings) and the
    expert slots (shared experts split into routed-shape chunks)."""
    from fiddler.weights import ExpertWeights, load_weights
    from tests.models import model_path

    path = model_path(arch)
    cfg = MoEConfig.from_pretrained(path)
    w = load_weights(path, cfg, dtype=torch.float32)

    def numel(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel()
        if isinstance(x, ExpertWeights):
            return sum(t.numel() for t in (x.w1, x.w3, x.w2))
        if isinstance(x, dict):
            return sum(numel(v) for v in x.values())
        return 0

    non_expert = w.embed.numel() + w.norm.numel() + (0 if w.lm_head is w.embed else w.lm_head.numel())
    non_expert += sum(numel(x) for l in w.layers for x in vars(l).values())
    assert non_expert * 4 == cfg.non_expert_bytes(torch.float32)
    assert len(w.experts) == cfg.num_moe_layers and all(len(row) == cfg.expert_slots for row in w.experts)
    assert all(numel(e) * 4 == cfg.expert_bytes(torch.float32) for row in w.experts for e in row)
    assert cfg.kv_cache_bytes(10, 1, torch.float32) == 4 * 10 * cfg.num_layers * (
        cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.attention == "mla" else 2 * cfg.num_kv_heads * cfg.head_dim)
