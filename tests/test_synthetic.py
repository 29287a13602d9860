"""Tests for the synthetic Mixtral checkpoint generator (runners/synthetic.py)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from runners import synthetic as syn
from runners.models import preset

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = preset("tiny_mixtral")[0]


def _sha(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_all(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                assert k not in out, f"{k} stored twice"
                out[k] = fh.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("synthetic_cache")


@pytest.fixture(scope="module")
def tiny(cache) -> pathlib.Path:
    return syn.ensure_synthetic_model("tiny_mixtral", TINY, 0, cache, progress=False)


def test_unknown_arch_keys_raise_naming_them():
    with pytest.raises(ValueError, match="hiden_size"):
        syn.resolve_arch({"hiden_size": 64})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        syn.resolve_arch({"num_attention_heads": 4, "num_key_value_heads": 3})


def test_defaults_are_mixtral():
    a = syn.resolve_arch({})
    assert (a["hidden_size"], a["intermediate_size"], a["num_local_experts"], a["head_dim"]) == (4096, 14336, 8, 128)


def test_checkpoint_uses_hub_key_format(tiny):
    keys = set(_load_all(tiny))
    assert keys == {s.name for s in syn.tensor_specs(TINY)}
    assert "model.layers.3.block_sparse_moe.experts.7.w2.weight" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert "lm_head.weight" in keys and "model.norm.weight" in keys
    assert (tiny / "model.safetensors").exists() and not (tiny / "model.safetensors.index.json").exists()
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    assert cfg["torch_dtype"] == "bfloat16" and cfg["vocab_size"] == 1024
    assert cfg["architectures"] == ["MixtralForCausalLM"]  # llama.cpp's converter dispatches on it
    assert (tiny / "generation_config.json").exists()


def test_deterministic_byte_identical(tiny, tmp_path):
    # A fresh cache root also retrains the tokenizer from scratch.
    again = syn.ensure_synthetic_model("tiny_mixtral", TINY, 0, tmp_path, progress=False)
    assert again.name == tiny.name
    for f in ("model.safetensors", "tokenizer.model", "config.json"):
        assert _sha(again / f) == _sha(tiny / f), f
    other = syn.ensure_synthetic_model("tiny_mixtral", TINY, 1, tmp_path, progress=False)
    assert other.name != tiny.name
    assert _sha(other / "model.safetensors") != _sha(tiny / "model.safetensors")
    assert _sha(other / "tokenizer.model") == _sha(tiny / "tokenizer.model")  # tokenizer is seed-independent


def test_tensor_independent_of_thread_count():
    spec = syn.TensorSpec("model.layers.0.block_sparse_moe.experts.0.w1.weight", (512, 1024), "normal", 0.03)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = syn.make_tensor(spec, 0)
        torch.set_num_threads(max(2, n))
        b = syn.make_tensor(spec, 0)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(a, b)


_ISA_SPECS = [syn.TensorSpec("w", (257, 129), "normal", 0.05), syn.TensorSpec("n", (4096,), "norm")]
_ISA_SCRIPT = (
    "import hashlib, sys; from runners import synthetic as syn; from tests.test_synthetic import _ISA_SPECS; "
    "print([hashlib.sha256(syn.make_tensor(s, 3).view(__import__('torch').uint8).numpy().tobytes()).hexdigest() "
    "for s in _ISA_SPECS])"
)


def test_tensor_bytes_independent_of_cpu_isa():
    # PyTorch picks vectorized kernels per CPU (DEFAULT/AVX2/AVX512); a checkpoint made on one
    # machine must match the one made on another (e.g. the GPU host), so force the scalar path.
    import os

    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _ISA_SCRIPT], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    here = [hashlib.sha256(syn.make_tensor(s, 3).view(torch.uint8).numpy().tobytes()).hexdigest() for s in _ISA_SPECS]
    assert out == str(here)


def test_init_scales():
    w = syn.make_tensor(syn.TensorSpec("w", (1024, 1024), "normal", 0.05), 0, "float32")
    assert abs(w.mean()) < 1e-3 and abs(w.std() - 0.05) < 1e-3
    n = syn.make_tensor(syn.TensorSpec("n", (4096,), "norm"), 0, "float32")
    assert abs(n.mean() - 1) < 0.01 and abs(n.std() - syn.NORM_JITTER) < 0.01


def test_changed_arch_gets_new_directory(tiny, cache):
    other = syn.ensure_synthetic_model("tiny_mixtral", {**TINY, "num_hidden_layers": 2}, 0, cache, progress=False)
    assert other != tiny and other.name.startswith("tiny_mixtral-")
    assert "model.layers.2.input_layernorm.weight" not in _load_all(other)


def test_transformers_loads_fused_experts_equal_and_forward_is_sane(tiny):
    from transformers import MixtralForCausalLM

    model, info = MixtralForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    saved = _load_all(tiny)
    f = TINY["intermediate_size"]
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}.block_sparse_moe."
        assert torch.equal(layer.mlp.gate.weight, saved[p + "gate.weight"])
        for e in range(TINY["num_local_experts"]):
            gate_up = layer.mlp.experts.gate_up_proj[e]
            assert torch.equal(gate_up[:f], saved[f"{p}experts.{e}.w1.weight"])
            assert torch.equal(gate_up[f:], saved[f"{p}experts.{e}.w3.weight"])
            assert torch.equal(layer.mlp.experts.down_proj[e], saved[f"{p}experts.{e}.w2.weight"])
        assert torch.equal(layer.self_attn.q_proj.weight, saved[f"model.layers.{i}.self_attn.q_proj.weight"])
        assert torch.equal(layer.input_layernorm.weight, saved[f"model.layers.{i}.input_layernorm.weight"])
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])

    ids = torch.randint(3, TINY["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    logits = out.logits.float()
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.3  # not collapsed
    assert len(set(logits[0].argmax(-1).tolist())) > 5  # next-token choice varies with context
    # Routing must be non-degenerate: every expert chosen somewhere, and choices vary by token.
    for r in out.router_logits:
        top = r.float().topk(TINY["num_experts_per_tok"], -1).indices
        counts = torch.bincount(top.flatten(), minlength=TINY["num_local_experts"])
        assert (counts > 0).all(), counts
        assert counts.max() < 0.6 * top.shape[0]


def test_sharded_equals_unsharded_and_loads(tiny, cache):
    sharded = syn.ensure_synthetic_model("tiny_mixtral", TINY, 0, cache, shard_size_mb=2, progress=False)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    a, b = _load_all(tiny), _load_all(sharded)
    assert set(a) == set(b) == set(index["weight_map"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    for k, fname in index["weight_map"].items():
        with safe_open(str(sharded / fname), "pt") as fh:
            assert k in fh.keys()

    from transformers import MixtralForCausalLM

    _, info = MixtralForCausalLM.from_pretrained(sharded, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_tokenizer_vocab_specials_and_round_trip(tiny):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(tiny / "tokenizer.model"))
    assert sp.get_piece_size() == TINY["vocab_size"]
    assert [sp.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2)
    assert sp.id_to_piece(3) == "<0x00>" and sp.is_byte(3)
    text = "The model routes 2048 tokens: naïve café — 東京 🙂!"
    ids = sp.encode(text)
    assert sp.decode(ids) == text
    assert sp.unk_id() not in ids  # byte fallback covers everything

    tok = AutoTokenizer.from_pretrained(tiny)
    assert len(tok) == TINY["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    hf_ids = tok(text)["input_ids"]
    assert hf_ids == [1] + ids  # fast tokenizer agrees with SentencePiece (llama.cpp reads the latter)
    assert tok.decode(hf_ids, skip_special_tokens=True) == text
    common = sp.encode("the water")
    assert len(common) <= 4  # English words got merged pieces, not just characters


def _ensure_in_child(root: str, q) -> None:
    q.put(str(syn.ensure_synthetic_model("race", TINY, 7, root, progress=False)))


def test_concurrent_processes_produce_one_valid_directory(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(str(tmp_path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    paths = {q.get(timeout=5), q.get(timeout=5)}
    assert len(paths) == 1
    (path,) = paths
    entries = [p.name for p in tmp_path.iterdir() if p.name not in (".locks", "tokenizers")]
    assert entries == [pathlib.Path(path).name]
    prov = json.loads((pathlib.Path(path) / syn.PROVENANCE_FILE).read_text())
    assert prov["sha256"]["model.safetensors"] == _sha(pathlib.Path(path) / "model.safetensors")


def test_cli_reuses_the_api_cache(tiny, cache):
    cmd = [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--preset", "tiny_mixtral",
           "--out", str(cache), "--quiet", "--seed", "0"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    if (REPO / "conf" / "model" / "tiny_mixtral.yaml").exists():
        assert pathlib.Path(out).name.startswith("tiny_mixtral-")  # conf may define its own arch
    else:
        assert pathlib.Path(out) == tiny


def test_full_size_vocab_trains_exactly(tmp_path):
    # small_mixtral and Mixtral-8x7B use 32000 pieces; training must reach exactly that.
    import sentencepiece as spm

    path = syn.ensure_tokenizer(32000, tmp_path)
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert sp.get_piece_size() == 32000
    text = "The expert model will compute each token in the first layer and then move the water."
    assert len(sp.encode(text)) < len(text) / 3  # real merges, not a byte/char-level vocab
    assert syn.ensure_tokenizer(32000, tmp_path) == path  # cached
