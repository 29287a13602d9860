"""system=llama_cpp_server (systems/llama_cpp/server_adapter.py): llama.cpp's own server's command line (the
GGUF and the binary injected) and the reason it gives where the binary is not built. The server itself runs
in benchmarks (its build takes minutes)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from systems.base import ModelSpec, RunContext, SystemUnavailable
from systems.llama_cpp import server_adapter, server_build
from systems.llama_cpp.config import LlamaCppConfig

SERVE = SimpleNamespace(host="127.0.0.1", port=8124, slots=16, token_budget=512, max_seq_len=256, api_key="k")


def _adapter(**options):
    config = LlamaCppConfig.build(**options)
    return server_adapter.LlamaServerAdapter(config, ModelSpec("small_mixtral", "/models/sm", "bfloat16"),
                                             RunContext(threads=2, gpu_memory_gb=0, has_cuda=False, cache_dir="/c"))


def test_the_command_batches_over_the_serve_slots(monkeypatch, tmp_path):
    exe = tmp_path / "llama-server"
    monkeypatch.setattr(server_adapter, "find_llama_server", lambda: exe)
    monkeypatch.setattr(server_adapter.convert, "ensure_gguf", lambda *a, **k: tmp_path / "m-bf16.gguf")
    a = _adapter()
    cmd = a.server_command(SERVE)
    assert cmd[0] == str(exe) and "--cont-batching" in cmd and "--metrics" in cmd
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags["--model"] == str(tmp_path / "m-bf16.gguf") and flags["--alias"] == "small_mixtral"
    assert flags["--parallel"] == "16" and flags["--ctx-size"] == str(256 * 16)  # max_seq_len per slot
    assert flags["--threads"] == "2" and flags["--n-gpu-layers"] == "0" and flags["--cache-type-k"] == "f16"
    assert "k" not in cmd and a.server_api_key_env == "LLAMA_API_KEY" and a.server_health_path == "/health"


def test_without_the_binary_it_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("FIDDLER_LLAMA_SERVER", str(tmp_path / "absent"))
    assert server_build.find_llama_server() is None
    with pytest.raises(SystemUnavailable, match="install.sh --llama-server"):
        _adapter().server_command(SERVE)


def test_a_build_for_other_flags_is_kept_apart():
    a = server_build.binary_path(["-DGGML_AVX512=ON"])
    b = server_build.binary_path(["-DGGML_AVX512=OFF"])
    assert a != b and a.name == b.name == "llama-server"
