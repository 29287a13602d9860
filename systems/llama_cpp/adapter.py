"""``system=llama_cpp``: the real llama.cpp (via llama-cpp-python) on the run's own checkpoint.

The run's Hugging Face checkpoint is converted to GGUF with llama.cpp's converter (cached, keyed
by the checkpoint's content hash and the quant type), loaded through llama.cpp's C API, and fed
the request's token ids directly (no re-tokenising). Greedy decoding produces exactly
``max_new_tokens`` argmax tokens (end-of-sequence is an ordinary token); ``beam_width > 1`` runs
:func:`systems.llama_cpp.beam.beam_search` on llama.cpp's KV-cache sequences.

Options (``systems/llama_cpp/config.py``):

- ``quant``: ``bf16`` (default), ``f32``, ``f16``, ``q8_0`` (written by the converter) or a
  quantizer type (``q4_0``, ``q4_k_m``, ... see :data:`convert.SUPPORTED_QUANTS`);
- ``quant_policy``: for ``q8_0`` / ``q4_0``: ``pure`` (default; like for like with fiddler's
  ``system.quant``: ``llama_model_quantize`` from the bf16 GGUF with ``pure=True``,
  ``quantize_output_tensor=False``, ``token_embedding_type=BF16``) or ``llama`` (llama.cpp's own mix);
- ``n_gpu_layers``: layers offloaded to the GPU (llama.cpp's ``-ngl``; -1 = all). Needs a GPU build
  of llama-cpp-python. null (the default) derives it from the GPU budget on a CUDA machine, as many
  whole layers as fit, as the Fiddler paper ran it (:func:`systems.llama_cpp.layers.gpu_layers`,
  the same function the simulator's llama.cpp policy uses); 0 without CUDA;
- ``n_cpu_moe``: keep the expert FFN tensors of the first N layers in host memory (llama.cpp's
  ``--n-cpu-moe``), implemented with ``tensor_buft_overrides``; -1 = every layer on the GPU and N as
  small as the GPU budget allows (on CUDA; :func:`systems.llama_cpp.layers.cpu_moe_layers`);
- ``n_ctx``: KV-cache cells; null = 4096 (at most the training context), grown (context rebuilt,
  ``stats.context_rebuilt``) when a request needs more (prompt + beams x new tokens);
- ``n_batch``: prompt tokens per ``llama_decode`` (also the micro-batch);
- ``flash_attn``: auto | on | off; ``kv_cache_type``: f16 (llama.cpp's default) | bf16 | f32 | q8_0 |
  q4_0; ``threads``: null = the environment's thread count;
- ``converter_dir``: a llama.cpp source tree holding ``convert_hf_to_gguf.py`` (null = fetched);
- ``verbose``: print llama.cpp's log.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from systems.base import (
    GenerationRequest,
    GenerationResult,
    SystemAdapter,
    SystemUnavailable,
)

from . import convert
from .config import LlamaCppConfig

#: KV-cache sequences of a fresh context (beam widths up to this need no context rebuild)
DEFAULT_SEQS = 16
#: KV-cache cells of a fresh context when n_ctx is null (grown on demand by a larger request)
DEFAULT_CTX = 4096


def _round_up(n: int, m: int = 256) -> int:
    return (n + m - 1) // m * m


def parse_system_info(text: str) -> dict[str, Any]:
    """``"CPU : AVX512 = 1 | AMX_INT8 = 0 | ..."`` -> {"AVX512": 1, "AMX_INT8": 0, ...}."""
    feats: dict[str, Any] = {}
    for name, val in re.findall(r"([A-Za-z0-9_]+) = ([^|]+?)\s*(?=\||$)", text):
        val = val.strip()
        feats[name] = int(val) if val.isdigit() else val
    return feats


class LlamaCppAdapter(SystemAdapter):
    token_accounting = "returned_sequence"

    config: LlamaCppConfig

    def __init__(self, config: LlamaCppConfig, model, ctx):
        super().__init__(config, model, ctx)
        self.threads = int(config.threads or ctx.threads or 1)
        self.llm = None
        self.gguf_path = None
        self._lc = None

    @property
    def pure_quant(self) -> bool:
        """q8_0 / q4_0 under the like-for-like policy (quant_policy=pure, the default for those types)."""
        return self.config.quant in convert.PURE_TYPES and self.config.quant_policy.value == "pure"

    @property
    def weight_quant(self) -> str | None:
        """For the decode bound's byte count (fiddler.quant): the expert/attention weight type when the
        GGUF follows fiddler's policy, None for bf16 (dense like fiddler's bf16 engine), "unmodelled" for
        llama.cpp's own mixes and other types."""
        q = self.config.quant
        if q == "bf16":
            return None
        return q if self.pure_quant else "unmodelled"

    # ------------------------------------------------------------------------------------------
    def load(self) -> None:
        if self.config.original:
            raise SystemUnavailable("system.original=true models the paper's 2024 llama.cpp build (llama_beam_search) "
                                    "in mode=simulate only")
        try:
            import llama_cpp
        except ImportError as exc:
            raise SystemUnavailable(f"llama-cpp-python is not installed: {exc}; install the extra: "
                                    f"{convert.EXTRA_HINT}") from exc
        except OSError as exc:  # the shared library failed to load
            raise SystemUnavailable(f"llama-cpp-python's shared library failed to load: {exc}") from exc
        self._lc = llama_cpp
        c = self.config
        ngl, n_cpu_moe, self.ngl_source = self.resolve_offload()
        if ngl != 0 and not llama_cpp.llama_supports_gpu_offload():
            raise SystemUnavailable(
                f"n_gpu_layers={ngl} ({self.ngl_source}) needs a GPU build of llama-cpp-python (this one is "
                f"CPU-only); rebuild with CMAKE_ARGS=\"-DGGML_CUDA=ON\" or set system.n_gpu_layers=0")
        from .engine import LlamaCppModel, LoadParams

        self.gguf_path = convert.ensure_gguf(self.model.path, c.quant, self.ctx.cache_dir, c.converter_dir,
                                             self.threads, pure=self.pure_quant)
        n_ctx = c.n_ctx if c.n_ctx is not None else DEFAULT_CTX
        params = LoadParams(threads=self.threads, n_ctx=n_ctx, n_batch=c.n_batch, n_seq_max=DEFAULT_SEQS,
                            n_gpu_layers=ngl, n_cpu_moe=n_cpu_moe, flash_attn=c.flash_attn.value,
                            kv_cache_type=c.kv_cache_type, verbose=c.verbose)
        self.llm = LlamaCppModel(self.gguf_path, params)
        if c.n_ctx is None and self.llm.n_ctx > self.llm.n_ctx_train > 0:
            self.llm.new_context(_round_up(self.llm.n_ctx_train), DEFAULT_SEQS)

    def resolve_offload(self) -> tuple[int, int, str]:
        """(-ngl, --n-cpu-moe, where they came from). system.n_gpu_layers when set; else, on a CUDA
        machine, as many whole layers as the GPU budget holds; with system.n_cpu_moe=-1, every layer on
        the GPU and the expert FFNs of as few first layers as the budget needs in host memory
        (systems/llama_cpp/layers.py, shared with the simulator); without CUDA nothing is offloaded."""
        c = self.config
        derive_moe = c.n_cpu_moe == -1
        if c.n_gpu_layers is not None and not derive_moe:
            return int(c.n_gpu_layers), c.n_cpu_moe, "system.n_gpu_layers"
        budget_gb = float(self.ctx.gpu_memory_gb or 0)
        if not self.ctx.has_cuda or budget_gb <= 0:  # nothing to derive from: -ngl 0, --n-cpu-moe as asked
            return (0, max(0, c.n_cpu_moe), "no CUDA GPU" if not self.ctx.has_cuda else "environment.gpu.memory_gb=0")
        from fiddler.config import MoEConfig

        from .layers import cpu_moe_layers, gpu_layers

        n_ctx = max(c.n_ctx or DEFAULT_CTX, int(self.ctx.max_seq_len) * max(1, int(self.ctx.max_batch)))
        fit = (cpu_moe_layers if derive_moe else gpu_layers)(
            MoEConfig.from_pretrained(self.model.path), int(budget_gb * 2**30), c.quant, n_ctx, c.kv_cache_type)
        self.gpu_layers_fit = fit.as_dict()
        if derive_moe:
            where = f"all layers with the expert FFNs of the first {fit.n_cpu_moe} in host memory"
        else:
            where = f"{fit.gpu_layers} whole layers{' and the output layer' if fit.output_on_gpu else ''}"
        return fit.n_gpu_layers, fit.n_cpu_moe, f"derived from environment.gpu.memory_gb={budget_gb:g}: {where} fit"

    # llama-cpp-python's server has no /health: its model list answers once the model is loaded
    server_health_path = "/v1/models"

    def server_command(self, serve) -> list[str]:
        """llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`, its `server` extra) on the
        GGUF of the same weights, with this system's -ngl, threads, context and batch. It decodes one request
        at a time (no continuous batching), and runs with interrupt_requests off so that a new request waits
        for the one in flight instead of cutting it short."""
        import importlib.util
        import sys

        missing = [m for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings", "fastapi",
                               "uvicorn") if importlib.util.find_spec(m) is None]
        if missing:
            raise SystemUnavailable(f"llama_cpp.server needs {', '.join(missing)}: pip install "
                                    f"'llama-cpp-python[server]' (or the project's server extra)")
        c = self.config
        ngl, n_cpu_moe, self.ngl_source = self.resolve_offload()
        if n_cpu_moe:
            raise SystemUnavailable("llama_cpp.server has no --n-cpu-moe; serve with system.n_cpu_moe=0")
        self.gguf_path = convert.ensure_gguf(self.model.path, c.quant, self.ctx.cache_dir, c.converter_dir,
                                             self.threads, pure=self.pure_quant)
        n_ctx = min(serve.max_seq_len, c.n_ctx or serve.max_seq_len)
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf_path), "--model_alias",
                self.model.name, "--host", serve.host, "--port", str(serve.port), "--n_ctx", str(n_ctx),
                "--n_batch", str(c.n_batch), "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
                "--n_gpu_layers", str(ngl), "--interrupt_requests", "False"]

    def server_notes(self) -> dict[str, Any]:
        return {"server": "llama_cpp.server (llama-cpp-python): one request at a time, interrupt_requests=False",
                "gguf": str(self.gguf_path), "n_gpu_layers_source": self.ngl_source}

    def _ensure_context(self, request: GenerationRequest) -> bool:
        """Grow the context if the request needs more cells or sequences. True if rebuilt."""
        width = max(1, int(request.beam_width))
        need = len(request.input_ids) + width * int(request.max_new_tokens) + 1
        if self.config.n_ctx is not None:
            if need > self.llm.n_ctx:
                raise ValueError(f"request needs {need} KV-cache cells but system.n_ctx={self.llm.n_ctx}")
            if width > self.llm.n_seq_max:
                self.llm.new_context(self.llm.n_ctx, width)
                return True
            return False
        if need > self.llm.n_ctx or width > self.llm.n_seq_max:
            self.llm.new_context(max(_round_up(need), self.llm.n_ctx), max(width, self.llm.n_seq_max))
            return True
        return False

    def generate(self, request: GenerationRequest, on_first_token: Callable[[], None]) -> GenerationResult:
        if self.llm is None:
            raise RuntimeError("LlamaCppAdapter.generate called before load()")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        bad = [t for t in request.input_ids if not 0 <= int(t) < self.llm.n_vocab]
        if bad:
            raise ValueError(f"token ids outside the GGUF vocabulary (size {self.llm.n_vocab}): {bad[:5]}")
        rebuilt = self._ensure_context(request)
        stats: dict[str, Any] = {"context_rebuilt": rebuilt, "n_ctx": self.llm.n_ctx}
        if request.beam_width <= 1:
            tokens = self.llm.greedy(request.input_ids, request.max_new_tokens, on_first_token)
            stats["decoded_tokens"] = len(request.input_ids) + len(tokens) - 1
        else:
            from .beam import beam_search

            res = beam_search(self.llm, request.input_ids, request.max_new_tokens, request.beam_width,
                              on_first_token)
            tokens = res.tokens
            stats.update(beam_score=res.score, beam_logprob=res.logprob, decoded_tokens=res.decoded_tokens)
        return GenerationResult(tokens=tokens, stats=stats)

    def teacher_forced_logits(self, input_ids: list[int]):
        """[len(input_ids), vocab] float32 logits of every position (for numerical checks)."""
        self._ensure_context(GenerationRequest(input_ids=list(input_ids), max_new_tokens=1))
        self.llm.clear()
        return self.llm.prefill(list(input_ids), all_logits=True)

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"options": self.config.to_dict(), "threads": self.threads,
                               "quant": self.config.quant, "weight_quant": self.weight_quant,
                               "quant_policy": ("pure (experts and attention in the type, embeddings and output bf16)"
                                                if self.pure_quant else "llama.cpp's own for the type")}
        if getattr(self, "ngl_source", None):
            out["n_gpu_layers_source"] = self.ngl_source
        if getattr(self, "gpu_layers_fit", None):
            out["gpu_layers_fit"] = self.gpu_layers_fit
        try:
            out["llama_cpp_python_version"] = convert.llama_cpp_python_version()
        except SystemUnavailable:
            return out
        if self._lc is not None:
            sysinfo = self._lc.llama_print_system_info()
            sysinfo = sysinfo.decode(errors="replace") if isinstance(sysinfo, bytes) else str(sysinfo)
            out["system_info"] = sysinfo.strip()
            out["build_features"] = parse_system_info(sysinfo)
            out["supports_gpu_offload"] = bool(self._lc.llama_supports_gpu_offload())
        if self.llm is not None:
            out.update(self.llm.describe())
        out["beam_search"] = "systems.llama_cpp.beam (llama_memory_seq_cp per beam, unified KV cache)"
        out["tokens"] = "request token ids fed directly (no re-tokenising); EOS ignored"
        return out

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
