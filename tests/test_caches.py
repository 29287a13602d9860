"""Caches and input files that cannot produce wrong numbers (issue 20): the engine's quant cache and the
llama.cpp baseline's GGUF cache are verified at load and rebuilt, with a warning naming the file, when they
do not hold what they claim; a damaged GGUF given with gguf= fails naming the file and what is wrong."""
from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest

import fiddler.kernels as fk
from fiddler import Engine
from tests.models import model_path, prompt

needs_kernel = pytest.mark.skipif(not fk.is_available(), reason=f"kernel library not built: {fk.load_error()}")


def _greedy(engine, ids) -> list[int]:
    return engine.generate(ids, max_new_tokens=8).tokens.tolist()


def _load_recording_warnings(**kw):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = Engine.from_pretrained(model_path("e8k2"), **kw)
    return engine, [str(w.message) for w in seen]


def _flip_scale_bit(file: Path, tensor: str) -> None:
    """One bit of the fp16 scale of `tensor`'s first block (an exponent bit): the file keeps its size."""
    raw = bytearray(file.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    start = json.loads(raw[8:8 + n])[tensor]["data_offsets"][0] + 8 + n
    raw[start + 1] ^= 0x40
    file.write_bytes(bytes(raw))


@needs_kernel
def test_bit_flipped_quant_cache_is_rebuilt_not_used(tmp_path):
    ids = prompt(12, 512)
    clean, _ = _load_recording_warnings(quant="q4_0", quant_cache=tmp_path)
    want = _greedy(clean, ids)
    (file,) = tmp_path.glob("*-q4_0-v1.safetensors")
    size = file.stat().st_size
    _flip_scale_bit(file, "l0.qkv")
    assert file.stat().st_size == size
    engine, seen = _load_recording_warnings(quant="q4_0", quant_cache=tmp_path)
    assert _greedy(engine, ids) == want
    assert engine.info()["quant_info"]["source"] == "quantized at load"
    assert any(str(file) in m and "sha256" in m for m in seen), seen
    # the rebuilt entry is sound: the next load takes it, without a warning
    again, seen = _load_recording_warnings(quant="q4_0", quant_cache=tmp_path)
    assert again.info()["quant_info"]["source"] == f"cache:{file}" and not seen


@needs_kernel
def test_quant_cache_of_another_type_names_the_file_and_is_rebuilt(tmp_path):
    ids = prompt(12, 512)
    want = _greedy(_load_recording_warnings(quant="q4_0", quant_cache=tmp_path / "clean")[0], ids)
    _load_recording_warnings(quant="q8_0", quant_cache=tmp_path)
    (q8,) = tmp_path.glob("*-q8_0-v1.safetensors")
    q4 = q8.with_name(q8.name.replace("-q8_0-", "-q4_0-"))
    shutil.copy(q8, q4)
    engine, seen = _load_recording_warnings(quant="q4_0", quant_cache=tmp_path)
    assert _greedy(engine, ids) == want
    assert any(str(q4) in m and "q8_0" in m for m in seen), seen
    # the same blocks labelled q4_0 (a consistent content hash): the block shapes give them away
    from safetensors.torch import load_file, save_file

    from fiddler import quant as fquant

    tensors = load_file(str(q8))
    meta = {**fquant.read_cache_metadata(q8), "quant": "q4_0", "sha256": fquant.tensors_sha256(tensors)}
    save_file(tensors, str(q4), metadata=meta)
    engine, seen = _load_recording_warnings(quant="q4_0", quant_cache=tmp_path)
    assert _greedy(engine, ids) == want
    assert any(str(q4) in m and "expected uint8 [" in m for m in seen), seen


def test_damaged_cached_gguf_is_rebuilt(tmp_path, monkeypatch):
    """The baseline's GGUF cache (convert.ensure_gguf), with the converter replaced by a stand-in that
    writes a fixed file: a cached GGUF whose bytes changed is converted again, with a warning naming it."""
    from systems.llama_cpp import convert

    made = []

    def fake_converter(model_dir, out, outtype, converter):
        made.append(out)
        out.write_bytes(b"GGUF" + bytes(range(256)) * 64)

    monkeypatch.setattr(convert, "run_converter", fake_converter)
    monkeypatch.setattr(convert, "find_converter", lambda *a, **k: tmp_path)
    monkeypatch.setattr(convert, "llama_cpp_python_version", lambda: "0.3.36")
    ckpt, cache = model_path("e8k2"), tmp_path / "cache"
    out = convert.ensure_gguf(ckpt, "bf16", cache)
    good = out.read_bytes()
    assert convert.ensure_gguf(ckpt, "bf16", cache) == out and len(made) == 1  # a sound entry is reused
    raw = bytearray(good)
    raw[1000] ^= 0x01
    out.write_bytes(bytes(raw))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert convert.ensure_gguf(ckpt, "bf16", cache) == out
    assert len(made) == 2 and out.read_bytes() == good
    assert any(str(out) in str(w.message) and "sha256" in str(w.message) for w in seen), [str(w.message) for w in seen]


def _small_gguf(path: Path) -> Path:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.ones((64, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_k.weight", np.ones((8, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def _bad_magic(raw: bytes) -> bytes:
    return b"GGML" + raw[4:]


def _truncated_data(raw: bytes) -> bytes:
    return raw[:-100]


def _truncated_header(raw: bytes) -> bytes:
    return raw[:40]


@needs_kernel
@pytest.mark.parametrize("damage, says", [(_bad_magic, "not a GGUF file (bad magic"),
                                          (_truncated_data, "truncated: tensor blk.0.attn_k.weight needs bytes"),
                                          (_truncated_header, "truncated header")])
def test_damaged_user_gguf_names_the_file_and_what_is_wrong(tmp_path, damage, says):
    bad = tmp_path / "model-q4_0.gguf"
    bad.write_bytes(damage(_small_gguf(tmp_path / "good.gguf").read_bytes()))
    with pytest.raises(ValueError, match=re.escape(f"gguf={bad}: {says}")):
        Engine.from_pretrained(model_path("e8k2"), quant="q4_0", gguf=bad)
