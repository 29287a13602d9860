"""Bad inputs through the harness: each gives a one-line error naming the problem, never an `ok`
record. (A damaged index line: tests/test_harness.py; a failing GGUF conversion: tests/test_llama_cpp.py.)
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

import runners  # noqa: F401
from runners.main import resolve_model_path, prepare, run_job
from runners.schema import ConfigError
from tests.test_cli import run_py

CONF = Path(__file__).resolve().parents[1] / "conf"


def cfg_of(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    return Path(resolve_model_path(prepare(cfg_of())[0]))


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors_fails_at_start(tmp_path, tiny_path):
    bad = copy_model(tiny_path, tmp_path / "m")
    f = next(bad.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    res = run_py(f"model.path={bad}", f"hydra.run.dir={tmp_path / 'run'}", f"run.index_path={tmp_path / 'i.jsonl'}",
                 timeout=300)
    assert res.returncode == 2
    first = res.stderr.strip().splitlines()[0]
    assert "truncated safetensors file" in first and f.name in first
    assert not (tmp_path / "i.jsonl").exists()


def test_corrupted_safetensors_header_names_the_file(tmp_path, tiny_path):
    bad = copy_model(tiny_path, tmp_path / "m")
    f = next(bad.glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32  # garbage in the JSON header
    f.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=f"{f.name}: corrupted safetensors header"):
        resolve_model_path(prepare(cfg_of(f"model.path={bad}"))[0])


def _with_header(f: Path, header: bytes) -> None:
    """f as a safetensors file whose JSON header is `header` (valid JSON), followed by some data."""
    import struct

    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)


WRONG_HEADERS = [b"[1,2,3]", b"5", b'{"w": 5}', b'{"w": {"dtype": "F32", "shape": [1]}}',
                 b'{"w": {"data_offsets": "x"}}', b'{"w": {"data_offsets": [0]}}',
                 b'{"w": {"data_offsets": [8, 4]}}', b'{"w": {"data_offsets": [0, true]}}']


@pytest.mark.parametrize("header", WRONG_HEADERS)
def test_safetensors_header_of_the_wrong_shape_names_the_file(tmp_path, tiny_path, header):
    """Bug 11 (issue 55): valid JSON of the wrong shape (a list, entries without data_offsets) was an
    AttributeError or KeyError at the start-up check, not the one-line error the README promises."""
    bad = copy_model(tiny_path, tmp_path / "m")
    f = next(bad.glob("*.safetensors"))
    _with_header(f, header)
    with pytest.raises(ConfigError, match=f"{f.name}: corrupted safetensors header"):
        resolve_model_path(prepare(cfg_of(f"model.path={bad}"))[0])


def test_safetensors_header_of_the_wrong_shape_exits_2_with_one_line(tmp_path, tiny_path):
    bad = copy_model(tiny_path, tmp_path / "m")
    f = next(bad.glob("*.safetensors"))
    _with_header(f, b"[1,2,3]")
    res = run_py(f"model.path={bad}", f"hydra.run.dir={tmp_path / 'run'}", f"run.index_path={tmp_path / 'i.jsonl'}",
                 timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f.name in lines[0] and "corrupted safetensors header" in lines[0], res.stderr[-2000:]


def test_prompt_longer_than_context_is_an_error_record(tmp_path):
    recs = run_job(cfg_of("system.adapter=tests.fake_systems:FakeSystem", "workload.input_lens=[8190,8]",
                          "workload.output_lens=[4]", "workload.repetitions=1", "run.isolation=inline",
                          "run.progress=false", f"run.index_path={tmp_path / 'i.jsonl'}"), tmp_path / "run")
    assert [r["status"] for r in recs] == ["error", "ok"]
    assert "8190 tokens + 4 new tokens exceeds the model's context of 8192" in recs[0]["reason"]


@pytest.mark.parametrize("system", ["hf_transformers", "fiddler"])
def test_nan_logits_are_detected(tmp_path, tiny_path, system):
    bad = copy_model(tiny_path, tmp_path / "m")
    f = next(bad.glob("*.safetensors"))
    tensors = load_file(str(f))
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    save_file(tensors, str(f), metadata={"format": "pt"})
    recs = run_job(cfg_of(f"system={system}", f"model.path={bad}", "workload=beam", "workload.beam_widths=[1]",
                          "workload.output_lens=[4]", "workload.repetitions=1", "workload.warmup=0",
                          "run.isolation=inline", "run.progress=false", f"run.index_path={tmp_path / 'i.jsonl'}"),
                   tmp_path / "run")
    assert [r["status"] for r in recs] == ["error"]
    reason = recs[0]["reason"].lower()
    assert reason.startswith("floatingpointerror") and ("nan" in reason or "non-finite" in reason)
