"""Small random MoE checkpoints (Mixtral and the other families) for engine tests, and the transformers
reference loaded from them.

Checkpoints come from runners.synthetic (original Hub key format, cached by content hash under
~/.cache/fiddler/models or $FIDDLER_CACHE), stored in fp32 so that both the engine and transformers
can load exactly the same values in fp32 or round them identically to bf16.
"""

from __future__ import annotations

import functools
import pathlib

import torch

from fiddler.executors import FiddlerPolicy, GpuSide, local_executor
from fiddler.latency import LatencyModel
from runners.synthetic import default_cache_root, ensure_synthetic_model

# name -> Mixtral arch overrides. Keep them small: the whole suite must stay in ~2 minutes on 2 cores.
ARCHS: dict[str, dict] = {
    # default Mixtral shape ratios: 8 experts, top-2, GQA 4:2
    "e8k2": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=512,
        max_position_embeddings=256,
    ),
    # odd sizes: 16 experts, top-4, hidden 72 with head_dim 12 (6 heads, 3 KV heads), ffn 100
    "e16k4_odd": dict(
        hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=3, num_local_experts=16, num_experts_per_tok=4, vocab_size=500,
        max_position_embeddings=256,
    ),
    # head_dim from config (not hidden/heads), MHA (no GQA), tied embeddings
    "hd_tied": dict(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=1,
        vocab_size=384, max_position_embeddings=128, tie_word_embeddings=True,
    ),
}

# The other families, one small model each, with the real models' routing/attention choices (see
# conf/model/tiny_*.yaml for the harness's). hidden 64, 2-3 layers: the numerics suites run on all of them.
FAMILY_ARCHS: dict[str, dict] = {
    # Qwen3-MoE: per-head q/k norm, renormalised top-k, head_dim from config
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, vocab_size=512, max_position_embeddings=256,
    ),
    # Qwen2-MoE: q/k/v biases, a gated shared expert (2.5 routed experts wide: split into 3 slots, padded),
    # top-k not renormalised, a dense layer via mlp_only_layers
    "qwen2_moe": dict(
        model_type="qwen2_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], vocab_size=512,
        max_position_embeddings=256,
    ),
    # OLMoE: q/k norm over the full width, top-k not renormalised, clip_qkv
    "olmoe": dict(
        model_type="olmoe", hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=16, num_experts_per_tok=4, vocab_size=512, max_position_embeddings=256,
        clip_qkv=8.0,
    ),
    # DeepSeek-V2: MLA with q_lora_rank, grouped top-k, 2 shared experts, a first dense layer, YaRN rope
    "deepseek_v2": dict(
        model_type="deepseek_v2", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=16, n_shared_experts=2,
        num_experts_per_tok=4, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, routed_scaling_factor=1.5, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, max_position_embeddings=256,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
    # DeepSeek-V2 without q_lora_rank (as V2-Lite) and greedy routing, default rope
    "deepseek_v2_lite": dict(
        model_type="deepseek_v2", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, topk_method="greedy", q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, max_position_embeddings=256,
    ),
    # DeepSeek-V3: sigmoid scores with the bias correction, grouped by top-2 sums, renormalised and scaled,
    # interleaved rope
    "deepseek_v3": dict(
        model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512,
        max_position_embeddings=256,
    ),
}
ARCHS.update(FAMILY_ARCHS)


def top_k_of(name: str) -> int:
    return ARCHS[name]["num_experts_per_tok"]


@functools.cache
def model_path(name: str, seed: int = 0) -> pathlib.Path:
    return ensure_synthetic_model(f"test-{name}", ARCHS[name], seed, default_cache_root(), dtype="float32", progress=False)


def hf_model(name: str, dtype: torch.dtype, **kw):
    """transformers' model of the family (MixtralForCausalLM, ...) on the same checkpoint, EOS disabled for
    generation."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path(name), dtype=dtype, **kw)
    m.eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def prompt(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)


# Engine variants: Engine.from_pretrained keyword arguments. One line per executor configuration; the
# numerics suites (test_model_numerics, test_batch) run every one.
VARIANTS = {
    "reference": dict(gpu=GpuSide.none(), executor=local_executor),
    "fiddler-cpu": dict(gpu=GpuSide.none()),  # Fiddler's executor, no GPU
}
# A budget makes the CPU device stand in for the GPU: placement, plans and weight copies run for real.
# This hand-made latency model copies experts in for multi-token batches and runs single tokens on the
# CPU, so decisions a, b and c all occur (per-kind checks: tests/test_executor.py).
MIX_LATENCY = LatencyModel.manual(cpu=(1e-4, 1e-3), gpu=(1e-5, 1e-4), transfer=1e-3)
# Every planner x 0%, 50% and 100% of experts resident on the emulated GPU.
for _placement, _name in (("none", "none"), ("fraction:0.5", "half"), ("all", "all")):
    for _planner in ("paper", "makespan"):
        VARIANTS[f"fiddler-emul-{_name}-{_planner}"] = dict(
            gpu=GpuSide.emulated(1 << 40),
            executor=FiddlerPolicy(placement=_placement, planner=_planner, latency_model=MIX_LATENCY))
# Decision kinds each emulated placement must produce with MIX_LATENCY (a: resident, b: copied in, c: CPU).
EXPECTED_KINDS = {"none": "bc", "half": "abc", "all": "a"}
