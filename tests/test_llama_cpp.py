"""llama.cpp baseline: same weights and token ids as transformers, same answers.

The tests that need llama.cpp skip cleanly without the ``llamacpp`` extra; the beam-search
bookkeeping is also checked without llama.cpp against a brute-force search on a fake model.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil

import numpy as np
import pytest
import torch

from systems.base import GenerationRequest, ModelSpec, RunContext, SystemUnavailable
from systems.llama_cpp import beam as beam_mod
from systems.llama_cpp.config import LlamaCppConfig
from systems.llama_cpp import convert

pytestmark = pytest.mark.llamacpp


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny():
    from runners.models import synthetic_model

    return synthetic_model("tiny_mixtral")


def _adapter(tiny, cache_dir, **options):
    pytest.importorskip("llama_cpp")
    from systems.llama_cpp.adapter import LlamaCppAdapter

    ctx = RunContext(threads=2, gpu_memory_gb=0.0, has_cuda=False, cache_dir=str(cache_dir))
    ad = LlamaCppAdapter(LlamaCppConfig.build(**options), ModelSpec(name=str(tiny.name), path=str(tiny)), ctx)
    try:
        ad.load()
    except SystemUnavailable as exc:
        if "converter is not available" in str(exc):  # offline and no converter cached
            pytest.skip(str(exc).splitlines()[0])
        raise
    return ad


@pytest.fixture(scope="module")
def gguf_cache():
    # converted GGUFs are keyed by checkpoint content hash, so the user cache is safe to share
    return convert._user_cache_root()


@pytest.fixture(scope="module")
def llama_f32(tiny, gguf_cache):
    # f32 weights, f32 KV cache, no flash attention (llama.cpp's CPU flash attention rounds Q to f16):
    # then llama.cpp computes the same function as transformers' fp32 to ~1e-5
    ad = _adapter(tiny, gguf_cache, quant="f32", kv_cache_type="f32", flash_attn="off")
    yield ad
    ad.close()


@pytest.fixture(scope="module")
def hf32(tiny):
    from transformers import MixtralForCausalLM

    m = MixtralForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    m.eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# ----------------------------------------------------------------------------- numerics vs transformers
def test_teacher_forced_top1_matches_transformers(llama_f32, hf32):
    ids = _prompt(96, hf32.config.vocab_size, seed=1)
    got = llama_f32.teacher_forced_logits(ids)
    with torch.no_grad():
        ref = hf32(torch.tensor([ids])).logits[0].float().numpy()
    assert got.shape == ref.shape
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    sure = margin > 1e-3
    assert sure.sum() >= 0.9 * len(ids), "too few positions with a clear top-1 to compare"
    mismatch = np.nonzero((got.argmax(-1) != ref.argmax(-1)) & sure)[0]
    assert mismatch.size == 0, f"top-1 differs at positions {mismatch.tolist()}"
    # and the logits themselves agree to fp32 rounding (measured: 3e-6 with |logit| up to 4)
    assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


def test_beam_search_returns_transformers_best_sequence(llama_f32, hf32):
    ids = _prompt(20, hf32.config.vocab_size, seed=2)
    n_new, width = 10, 4
    with torch.no_grad():
        out = hf32.generate(torch.tensor([ids]), num_beams=width, do_sample=False, max_new_tokens=n_new,
                            min_new_tokens=0, length_penalty=1.0, early_stopping=False,
                            num_return_sequences=1, return_dict_in_generate=True, output_scores=True)
    ref = out.sequences[0, len(ids):].tolist()
    first = []
    res = llama_f32.generate(GenerationRequest(input_ids=ids, max_new_tokens=n_new, beam_width=width),
                             lambda: first.append(1))
    assert first == [1]
    assert len(res.tokens) == n_new
    assert res.tokens == ref
    assert res.stats["beam_score"] == pytest.approx(float(out.sequences_scores[0]), abs=1e-3)


def test_greedy_exact_length_first_token_once_and_consistent(llama_f32, hf32):
    ids = _prompt(24, hf32.config.vocab_size, seed=3)
    for n_new in (1, 17):
        calls: list[int] = []
        res = llama_f32.generate(GenerationRequest(input_ids=ids, max_new_tokens=n_new),
                                 lambda c=calls: c.append(1))
        assert calls == [1]
        assert len(res.tokens) == n_new
    # incremental decoding == teacher-forced argmax over prompt + generated tokens
    full = ids + res.tokens
    logits = llama_f32.teacher_forced_logits(full)[len(ids) - 1:-1]
    srt = np.sort(logits, axis=-1)
    sure = (srt[:, -1] - srt[:, -2]) > 1e-3
    assert (logits.argmax(-1)[sure] == np.array(res.tokens)[sure]).all()
    # and the same tokens as transformers' fp32 greedy search
    with torch.no_grad():
        ref = hf32.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n_new, num_beams=1)
    assert res.tokens == ref[0, len(ids):].tolist()


def test_n_cpu_moe_override_loads_and_matches(tiny, gguf_cache, llama_f32):
    ids = _prompt(16, 1024, seed=4)
    ad = _adapter(tiny, gguf_cache, quant="f32", kv_cache_type="f32", flash_attn="off",
                  n_cpu_moe=2, n_batch=8)  # also: prompt in 2 chunks
    try:
        info = ad.info()
        assert info["n_cpu_moe"] == 2 and info["n_threads"] == 2 and info["n_threads_batch"] == 2
        assert info["model_ftype"] and "F32" in info["model_ftype"].upper()
        assert "AVX" in info["system_info"]
        got = ad.generate(GenerationRequest(input_ids=ids, max_new_tokens=8), lambda: None).tokens
    finally:
        ad.close()
    want = llama_f32.generate(GenerationRequest(input_ids=ids, max_new_tokens=8), lambda: None).tokens
    assert got == want


def test_context_grows_with_request(llama_f32):
    ids = _prompt(8, 1024, seed=5)
    n_ctx = llama_f32.llm.n_ctx
    res = llama_f32.generate(GenerationRequest(input_ids=ids, max_new_tokens=2, beam_width=20), lambda: None)
    assert res.stats["context_rebuilt"] and llama_f32.llm.n_seq_max >= 20 and len(res.tokens) == 2
    assert llama_f32.llm.n_ctx >= n_ctx


def test_gpu_layers_without_gpu_build_is_unavailable(tiny, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python build has a GPU backend")
    from systems.llama_cpp.adapter import LlamaCppAdapter

    ctx = RunContext(threads=2, gpu_memory_gb=0.0, has_cuda=False, cache_dir=str(tmp_path))
    ad = LlamaCppAdapter(LlamaCppConfig.build(n_gpu_layers=4), ModelSpec(name="t", path=str(tiny)), ctx)
    with pytest.raises(SystemUnavailable, match=r"n_gpu_layers=4 \(system.n_gpu_layers\) needs a GPU build"):
        ad.load()


# ----------------------------------------------------------------------------- conversion errors
def test_corrupted_checkpoint_names_the_problem(tiny, tmp_path):
    pytest.importorskip("llama_cpp")
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])  # truncated weights
    try:
        convert.find_converter()
    except SystemUnavailable as exc:
        pytest.skip(str(exc).splitlines()[0])
    with pytest.raises(convert.GGUFConversionError) as ei:
        convert.ensure_gguf(bad, "f32", tmp_path / "cache")
    first = str(ei.value).splitlines()[0]
    assert first.startswith(f"GGUF conversion of {bad} failed: ")
    assert len(first) > len(f"GGUF conversion of {bad} failed: ") + 5
    assert not list((tmp_path / "cache").rglob("*.gguf")), "no partial GGUF may stay in the cache"


def test_unsupported_architecture_is_unavailable(tiny, tmp_path):
    pytest.importorskip("llama_cpp")
    bad = tmp_path / "alien"
    bad.mkdir()
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"] = ["NoSuchMoEForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").symlink_to(tiny / "model.safetensors")
    try:
        convert.find_converter()
    except SystemUnavailable as exc:
        pytest.skip(str(exc).splitlines()[0])
    with pytest.raises(SystemUnavailable, match="llama.cpp cannot represent this checkpoint"):
        convert.ensure_gguf(bad, "f32", tmp_path / "cache")


def test_checkpoint_hash_memo_tracks_changes(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    w = d / "model.safetensors"
    w.write_bytes(b"abc")
    memo = tmp_path / "memo.json"
    h1 = convert.checkpoint_hash(d, memo)
    assert h1 == convert.checkpoint_hash(d) and json.loads(memo.read_text())
    assert convert.checkpoint_hash(d, memo) == h1
    st = w.stat()
    w.write_bytes(b"abd")  # same size, new content and mtime
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    h2 = convert.checkpoint_hash(d, memo)
    assert h2 != h1 and h2 == convert.checkpoint_hash(d)


def test_offline_without_converter_is_a_clear_unavailable(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("FIDDLER_CACHE", str(tmp_path))  # empty converter cache
    monkeypatch.delenv("FIDDLER_LLAMA_CPP_CONVERTER", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip can reach no package index
    monkeypatch.setenv("PIP_FIND_LINKS", " ")
    with pytest.raises(SystemUnavailable, match="converter is not available") as ei:
        convert.find_converter()
    assert "FIDDLER_LLAMA_CPP_CONVERTER" in str(ei.value)
    assert not (tmp_path / "llama_cpp_converter" / convert.llama_cpp_python_version()).exists()


def test_option_validation():
    """Checks live in the typed config (systems/llama_cpp/config.py), the adapter's one source."""
    with pytest.raises(ValueError, match="q3_x"):
        LlamaCppConfig.build(quant="q3_x")
    with pytest.raises(Exception, match="ngl"):
        LlamaCppConfig.build(ngl=3)
    with pytest.raises(ValueError, match="flash_attn"):
        LlamaCppConfig.build(flash_attn="yes")
    with pytest.raises(ValueError, match="kv_cache_type"):
        LlamaCppConfig.build(kv_cache_type="f8")
    with pytest.raises(ValueError, match="flash_attn"):
        LlamaCppConfig.build(kv_cache_type="q8_0", flash_attn="off")
    with pytest.raises(ValueError, match="n_ctx"):
        LlamaCppConfig.build(n_ctx=0)


# ----------------------------------------------------------------------------- beam bookkeeping (no llama.cpp)
class FakeLlama:
    """Stands in for LlamaCppModel: each KV sequence is the token history it holds, and the logits
    are a fixed pseudo-random function of that history, so a wrong seq_cp/seq_rm changes results."""

    def __init__(self, vocab: int, n_seq: int, seed: int = 0):
        self.n_vocab, self.n_seq_max, self.seed = vocab, n_seq, seed
        self.seqs: dict[int, list[int]] = {}
        self._rows: list[np.ndarray] = []

    def _logits(self, hist) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(hist)] + list(hist))
        return (rng.standard_normal(self.n_vocab) * 3).astype(np.float32)

    def clear(self):
        self.seqs = {}

    def seq_cp(self, src, dst):
        assert dst not in self.seqs, "copy into a live sequence"
        self.seqs[dst] = list(self.seqs[src])

    def seq_rm(self, s):
        self.seqs.pop(s, None)

    def prefill(self, ids, seq=0):
        self.seqs[seq] = list(ids)
        return self._logits(self.seqs[seq])

    def decode(self, tokens, positions, seq_ids, want):
        self._rows = []
        for t, p, s in zip(tokens, positions, seq_ids):
            assert len(self.seqs[s]) == p, "token decoded at the wrong position for its sequence"
            self.seqs[s].append(int(t))
            self._rows.append(self._logits(self.seqs[s]))

    def logits_view(self, i):
        return self._rows[i]


def _brute_force_beam(fake: FakeLlama, ids, n_new, width):
    """transformers' beam search written the obvious way: rescore every beam from its history."""
    beams = [([], 0.0)]
    for _ in range(n_new):
        cand = []
        for toks, sc in beams:
            lp = beam_mod.log_softmax(fake._logits(list(ids) + toks))
            cand += [(toks + [t], np.float32(sc) + lp[t]) for t in range(fake.n_vocab)]
        cand.sort(key=lambda c: -c[1])
        beams = cand[:width]
    return beams


@pytest.mark.parametrize("seed,width,n_new", [(0, 4, 6), (1, 3, 7), (2, 1, 5), (3, 5, 4)])
def test_beam_bookkeeping_matches_brute_force(seed, width, n_new):
    fake = FakeLlama(vocab=7, n_seq=width, seed=seed)
    ids = [1, 2, 3]
    calls = []
    res = beam_mod.beam_search(fake, ids, n_new, width, lambda: calls.append(1))
    ref = _brute_force_beam(fake, ids, n_new, width)
    assert calls == [1]
    assert res.tokens == ref[0][0]
    assert res.all_tokens == [b[0] for b in ref]
    assert res.logprob == pytest.approx(float(ref[0][1]), abs=1e-4)
    assert res.score == pytest.approx(float(ref[0][1]) / n_new, abs=1e-4)
    assert len(fake.seqs) == min(width, fake.n_vocab)


def test_top_k_flat_orders_best_first():
    x = np.array([0.1, 5.0, -1.0, 5.0, 3.0], dtype=np.float32)
    assert beam_mod.top_k_flat(x, 3).tolist() == [1, 3, 4]
    assert list(itertools.islice(beam_mod.top_k_flat(x, 10).tolist(), 5)) == [1, 3, 4, 0, 2]


# ----------------------------------------------------------------------------- other MoE families
# llama.cpp computes the same function as transformers for these generated checkpoints (SentencePiece
# vocabulary forced in the converter, spm_convert.py). DeepSeek-V2 is checked with greedy routing: with
# group_limited_greedy routing llama.cpp ranks expert groups differently (README, "llama.cpp baseline").
_DEEPSEEK_GREEDY = {"topk_method": "greedy", "n_group": 1, "topk_group": 1}


def _family_model(name: str):
    from runners.models import preset, synthetic_model
    from runners.synthetic import default_cache_root, ensure_synthetic_model

    if name == "tiny_deepseek_v2_greedy":
        arch, seed, dtype = preset("tiny_deepseek_v2")
        return ensure_synthetic_model(name, {**arch, **_DEEPSEEK_GREEDY}, seed, default_cache_root(), dtype=dtype,
                                      progress=False)
    return synthetic_model(name)


@pytest.mark.parametrize("name", ["tiny_qwen3_moe", "tiny_qwen2_moe", "tiny_olmoe", "tiny_deepseek_v2_greedy"])
def test_families_convert_and_match_transformers_greedy_fp32(name, gguf_cache):
    from transformers import AutoModelForCausalLM

    path = _family_model(name)
    assert convert.needs_spm_vocab(path)
    ad = _adapter(path, gguf_cache, quant="f32", kv_cache_type="f32", flash_attn="off")
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = _prompt(24, hf.config.vocab_size, seed=4)
        with torch.no_grad():
            ref_logits = hf(torch.tensor([ids])).logits[0].numpy()
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24, num_beams=1,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        got = ad.teacher_forced_logits(ids)
        assert np.abs(got - ref_logits).max() <= 1e-4 * np.abs(ref_logits).max()
        assert ad.generate(GenerationRequest(input_ids=ids, max_new_tokens=24), lambda: None).tokens == ref
    finally:
        ad.close()
