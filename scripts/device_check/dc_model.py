"""The device check's model: a Mixtral-architecture checkpoint generated on the machine, and its GGUF."""
from __future__ import annotations

import json
import math
import os
import pathlib

import torch

from dc_common import RESIDENT_SHARE, ROUTER_SKEW, Ctx, popularity_target


# --------------------------------------------------------------------------------------------- the model


def make_model(ctx: Ctx) -> pathlib.Path:
    """The shape's checkpoint, generated once per machine under ctx.cache (random weights, made on the GPU
    where there is one: nothing large travels to the device machine).

    Routing is skewed as the Mixtral profile: every embedding row carries a shared direction u (a constant
    offset that the residual stream keeps), and each router row adds skew * log(share) * u/|u|, so a
    token's router logits are shifted by that much times its stream's projection on u."""
    shape = ctx.shape
    path = ctx.cache / shape.name
    if (path / "done").exists():
        return path
    from safetensors.torch import save_file
    from transformers import MixtralConfig

    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    dev = ctx.device()
    g = torch.Generator(device=dev).manual_seed(0)
    H, F, E, V = shape.hidden, shape.ffn, shape.experts, shape.vocab
    hd = H // shape.heads
    qd, kvd = shape.heads * hd, shape.kv_heads * hd

    def rand(*dims, std):
        return (torch.randn(*dims, generator=g, device=dev, dtype=torch.float32) * std).to(torch.bfloat16).cpu()

    u = torch.randn(H, generator=g, device=dev).cpu()
    u = u / u.norm()
    shares = popularity_target(shape)
    emb = torch.randn(V, H, generator=g, device=dev).cpu() * 0.5 + 2.0 * u  # offset 2 per unit-norm u
    tensors = {"model.embed_tokens.weight": emb.to(torch.bfloat16), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
               "lm_head.weight": rand(V, H, std=H ** -0.5)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        skew = torch.tensor([math.log(max(s, 1e-3)) for s in shares[i]]) * ROUTER_SKEW / math.sqrt(H)
        router = torch.randn(E, H, generator=g, device=dev).cpu() * H ** -0.5 + skew[:, None] * u[None, :]
        tensors |= {p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                    p + "self_attn.q_proj.weight": rand(qd, H, std=H ** -0.5),
                    p + "self_attn.k_proj.weight": rand(kvd, H, std=H ** -0.5),
                    p + "self_attn.v_proj.weight": rand(kvd, H, std=H ** -0.5),
                    p + "self_attn.o_proj.weight": rand(H, qd, std=qd ** -0.5),
                    p + "block_sparse_moe.gate.weight": router.to(torch.bfloat16)}
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors |= {q + "w1.weight": rand(F, H, std=H ** -0.5), q + "w3.weight": rand(F, H, std=H ** -0.5),
                        q + "w2.weight": rand(H, F, std=F ** -0.5)}
        save_file(tensors, str(tmp / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
        tensors = {}
    index = {}
    from safetensors import safe_open

    for f in sorted(tmp.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            index |= {k: f.name for k in fh.keys()}
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    MixtralConfig(**shape.arch(), bos_token_id=1, eos_token_id=2, dtype="bfloat16",
                  sliding_window=None).save_pretrained(tmp)
    (tmp / "done").write_text("")
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def prompt_ids(n: int, seed: int = 1, vocab: int = 32000) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def budget_bytes(ctx: Ctx, cfg, max_seq_len: int, overhead: dict) -> tuple[int, int]:
    """A GPU budget holding the reservation plus RESIDENT_SHARE of the experts, and that expert count."""
    from fiddler.placement import reservation

    fixed = sum(reservation(cfg, torch.bfloat16, max_seq_len, 1, overhead=overhead).values())
    n = round(RESIDENT_SHARE * cfg.num_moe_layers * cfg.expert_slots)
    return fixed + n * int(cfg.expert_bytes(torch.bfloat16)), n


def gguf_from_checkpoint(ctx: Ctx, path: pathlib.Path) -> pathlib.Path:
    """llama.cpp's GGUF of the same tensors, written directly (no converter, no saved-model round trip):
    bf16 tensors in llama.cpp's names, q/k rows permuted to its rope layout, a byte-level SPM vocabulary."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    out = path / "model-bf16.gguf"
    if out.exists():
        return out
    shape = ctx.shape
    a = shape.arch()
    w = gguf.GGUFWriter(str(out) + ".partial", "llama")
    w.add_block_count(shape.layers)
    w.add_context_length(a["max_position_embeddings"])
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_rope_freq_base(a["rope_theta"])
    w.add_layer_norm_rms_eps(a["rms_norm_eps"])
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.top_k)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"t{i}" for i in range(shape.vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    files = sorted(path.glob("model-*.safetensors"))
    fhs = [safe_open(str(f), "pt") for f in files]
    where = {k: fh for fh in fhs for k in fh.keys()}

    def get(name):
        return where[name].get_tensor(name)

    def put(name, t):
        if t.dim() == 1 or name.endswith("ffn_gate_inp.weight"):  # norms and routers in f32, as llama.cpp's own
            w.add_tensor(name, t.float().numpy())
            return
        t = t.to(torch.bfloat16).contiguous()
        w.add_tensor(name, t.view(torch.int16).numpy().view(np.uint16), raw_shape=tuple(t.shape),
                     raw_dtype=gguf.GGMLQuantizationType.BF16)

    def rope_rows(t, heads):  # HF's rotate-half halves -> llama.cpp's interleaved pairs
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    put("token_embd.weight", get("model.embed_tokens.weight"))
    for i in range(shape.layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", get(p + "input_layernorm.weight"))
        put(b + "attn_q.weight", rope_rows(get(p + "self_attn.q_proj.weight"), shape.heads))
        put(b + "attn_k.weight", rope_rows(get(p + "self_attn.k_proj.weight"), shape.kv_heads))
        put(b + "attn_v.weight", get(p + "self_attn.v_proj.weight"))
        put(b + "attn_output.weight", get(p + "self_attn.o_proj.weight"))
        put(b + "ffn_norm.weight", get(p + "post_attention_layernorm.weight"))
        put(b + "ffn_gate_inp.weight", get(p + "block_sparse_moe.gate.weight"))
        for mine, theirs in (("ffn_gate_exps", "w1"), ("ffn_down_exps", "w2"), ("ffn_up_exps", "w3")):
            put(b + mine + ".weight", torch.stack([get(f"{p}block_sparse_moe.experts.{e}.{theirs}.weight")
                                                   for e in range(shape.experts)]))
    put("output_norm.weight", get("model.norm.weight"))
    put("output.weight", get("lm_head.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(out) + ".partial", out)
    return out
