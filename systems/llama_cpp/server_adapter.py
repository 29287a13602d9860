"""``system=llama_cpp_server``: llama.cpp's own HTTP server (``llama-server``) on the same GGUF as system=llama_cpp,
with continuous batching over ``serve.slots`` parallel slots (``--parallel``, ``--cont-batching``): the server a
user of llama.cpp runs, beside llama-cpp-python's, which serves one request at a time (system=llama_cpp).

The binary is built from the llama.cpp that llama-cpp-python's pinned sdist vendors, with this CPU's flags
(systems/llama_cpp/server_build.py; ``scripts/install.sh --llama-server``). Each slot gets serve.max_seq_len
context cells (``--ctx-size`` is the total, split among the slots), prompts are processed in n_batch chunks,
threads, -ngl, flash attention and the KV-cache type are this system's options, as for system=llama_cpp. Its
/metrics (``--metrics``) is kept in the serving records.
"""
from __future__ import annotations

from typing import Any

from systems.base import SystemUnavailable

from . import convert
from .adapter import LlamaCppAdapter
from .server_build import find_llama_server


class LlamaServerAdapter(LlamaCppAdapter):
    server_health_path = "/health"
    server_api_key_env = "LLAMA_API_KEY"  # llama-server's --api-key, read from its environment

    def server_command(self, serve) -> list[str]:
        exe = find_llama_server()
        if exe is None:
            raise SystemUnavailable("llama.cpp's llama-server is not built for this CPU: scripts/install.sh "
                                    "--llama-server (or python -m systems.llama_cpp.server_build; "
                                    "FIDDLER_LLAMA_SERVER=<binary> for one of your own)")
        c = self.config
        ngl, n_cpu_moe, self.ngl_source = self.resolve_offload()
        self.gguf_path = convert.ensure_gguf(self.model.path, c.quant, self.ctx.cache_dir, c.converter_dir,
                                             self.threads, pure=self.pure_quant)
        per_slot = min(serve.max_seq_len, c.n_ctx or serve.max_seq_len)
        cmd = [str(exe), "--model", str(self.gguf_path), "--alias", self.model.name, "--host", serve.host,
               "--port", str(serve.port), "--parallel", str(serve.slots), "--ctx-size", str(per_slot * serve.slots), "--batch-size", str(max(c.n_batch, serve.token_budget)),
               "--ubatch-size", str(c.n_batch), "--threads", str(self.threads), "--threads-batch", str(self.threads),
               "--n-gpu-layers", str(ngl), "--flash-attn", c.flash_attn.value, "--cache-type-k", c.kv_cache_type,
               "--cache-type-v", c.kv_cache_type]
        if n_cpu_moe:
            cmd += ["--n-cpu-moe", str(n_cpu_moe)]
        return cmd + ["--cont-batching", "--metrics", "--no-webui"]

    def server_notes(self) -> dict[str, Any]:
        return {"server": "llama.cpp llama-server: continuous batching over --parallel slots",
                "gguf": str(self.gguf_path), "n_gpu_layers_source": self.ngl_source,
                "binary": str(find_llama_server())}
