"""Small random Mixtral checkpoints for engine tests, and the transformers reference loaded from them.

Checkpoints come from runners.synthetic (original Hub key format, cached by content hash under
~/.cache/fiddler/models or $FIDDLER_CACHE), stored in fp32 so that both the engine and transformers
can load exactly the same values in fp32 or round them identically to bf16.
"""

from __future__ import annotations

import functools
import pathlib

import torch

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


@functools.cache
def model_path(name: str, seed: int = 0) -> pathlib.Path:
    return ensure_synthetic_model(f"test-{name}", ARCHS[name], seed, default_cache_root(), dtype="float32", progress=False)


def hf_model(name: str, dtype: torch.dtype):
    """transformers' MixtralForCausalLM on the same checkpoint, EOS disabled for generation."""
    from transformers import MixtralForCausalLM

    m = MixtralForCausalLM.from_pretrained(model_path(name), dtype=dtype)
    m.eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def prompt(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)
