"""A thin layer over llama.cpp's C API (llama-cpp-python's low-level ``llama_cpp`` module).

llama-cpp-python's high-level ``Llama`` class re-tokenises, keeps one sequence and (with
``logits_all=False``) leaves ``Llama.scores`` at zero, so this wrapper talks to the C API directly:
token ids in, positions and sequence ids chosen by us, logits read with ``llama_get_logits_ith``,
KV-cache sequences copied/removed with ``llama_memory_seq_*`` (``llama_kv_self_seq_*`` on older
versions). The KV cache is *unified* (one cell pool shared by all sequences), so a beam fork
(``seq_cp``) only tags cells with another sequence id -- no K/V data is copied.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_LOG_LEVELS = {0: "NONE", 1: "INFO", 2: "WARN", 3: "ERROR", 4: "DEBUG", 5: "CONT"}
_log_lines: collections.deque[tuple[str, str]] = collections.deque(maxlen=200)
_log_verbose = False
_log_cb = None  # keep the ctypes callback alive for the process lifetime
_backend_ready = False


def _install_logger(llama_cpp) -> None:
    """Route llama.cpp's log to a ring buffer (printed only when verbose) for error messages."""
    global _log_cb, _backend_ready
    if _log_cb is None:
        last = ["INFO"]

        def _cb(level, text, user_data):
            lvl = _LOG_LEVELS.get(level, "INFO")
            if lvl == "CONT":
                lvl = last[0]
            last[0] = lvl
            msg = text.decode("utf-8", errors="replace") if text else ""
            _log_lines.append((lvl, msg))
            if _log_verbose:
                print(msg, end="", flush=True, file=__import__("sys").stderr)

        _log_cb = llama_cpp.llama_log_callback(_cb)
        llama_cpp.llama_log_set(_log_cb, ctypes.c_void_p(0))
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _backend_ready = True


def recent_log(levels: tuple[str, ...] = ("WARN", "ERROR"), n: int = 12) -> str:
    lines = [m.rstrip() for lvl, m in _log_lines if lvl in levels and m.strip()]
    return "\n".join(lines[-n:])


def lib_dir(llama_cpp) -> Path:
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    return Path(override) if override else Path(llama_cpp.__file__).parent / "lib"


def _cpu_buffer_type(llama_cpp) -> int:
    """``ggml_backend_cpu_buffer_type()`` from the ggml-cpu library llama-cpp-python ships."""
    d = lib_dir(llama_cpp)
    for name in ("libggml-cpu.so", "libggml-cpu.dylib", "ggml-cpu.dll", "libggml.so", "libllama.so"):
        p = d / name
        if not p.exists():
            continue
        lib = ctypes.CDLL(str(p))
        fn = getattr(lib, "ggml_backend_cpu_buffer_type", None)
        if fn is not None:
            fn.restype = ctypes.c_void_p
            fn.argtypes = []
            ptr = fn()
            if ptr:
                return ptr
    raise RuntimeError(f"ggml_backend_cpu_buffer_type not found in {d}; cannot place MoE experts on the CPU")


class _BuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; };
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def moe_cpu_patterns(n_cpu_moe: int) -> list[str]:
    """Tensor-name regexes that keep the expert FFNs of the first n layers in host memory
    (the semantics of llama.cpp's ``--n-cpu-moe N``)."""
    return [rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps" for i in range(n_cpu_moe)]


@dataclass
class LoadParams:
    threads: int
    n_ctx: int
    n_batch: int = 512
    n_seq_max: int = 1
    n_gpu_layers: int = 0
    n_cpu_moe: int = 0
    flash_attn: str = "auto"  # auto | on | off
    kv_cache_type: str = "f16"  # f16 | bf16 | f32 | q8_0 | q4_0 (K and V)
    verbose: bool = False


#: ggml_type enum values (llama-cpp-python names most of them GGML_TYPE_*; BF16 is 30 in ggml.h)
KV_CACHE_TYPES = {"f32": ("GGML_TYPE_F32", 0), "f16": ("GGML_TYPE_F16", 1), "bf16": ("GGML_TYPE_BF16", 30),
                  "q8_0": ("GGML_TYPE_Q8_0", 8), "q4_0": ("GGML_TYPE_Q4_0", 2)}


class LlamaCppModel:
    """One loaded GGUF model and one context (KV cache) with up to ``n_seq_max`` sequences."""

    def __init__(self, gguf_path: str | os.PathLike, params: LoadParams):
        import llama_cpp

        global _log_verbose
        self.lc = llama_cpp
        _log_verbose = params.verbose
        _install_logger(llama_cpp)
        self.path = Path(gguf_path)
        self.params = params
        self.model = None
        self.ctx = None
        self._batch = None
        self._overrides = None

        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = int(params.n_gpu_layers)
        if params.n_cpu_moe > 0:
            buft = _cpu_buffer_type(llama_cpp)
            pats = [p.encode() for p in moe_cpu_patterns(params.n_cpu_moe)]
            arr = (_BuftOverride * (len(pats) + 1))()
            for i, p in enumerate(pats):
                arr[i].pattern = p
                arr[i].buft = buft
            arr[len(pats)].pattern = None
            arr[len(pats)].buft = None
            self._overrides = (arr, pats)  # keep alive while the model exists
            mparams.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
        _log_lines.clear()
        self.model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp failed to load {self.path}\n{recent_log()}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.n_layer = int(llama_cpp.llama_model_n_layer(self.model))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self.model))
        self.new_context(params.n_ctx, params.n_seq_max)

    # -- context ---------------------------------------------------------------------------
    def new_context(self, n_ctx: int, n_seq_max: int) -> None:
        lc = self.lc
        self._free_context()
        p = self.params
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = int(n_ctx)
        cparams.n_batch = int(max(p.n_batch, n_seq_max))
        cparams.n_ubatch = int(max(p.n_batch, n_seq_max))
        cparams.n_seq_max = int(n_seq_max)
        cparams.n_threads = int(p.threads)
        cparams.n_threads_batch = int(p.threads)
        cparams.kv_unified = True  # beams share one cell pool: seq_cp is metadata-only
        cparams.no_perf = False
        const, value = KV_CACHE_TYPES[p.kv_cache_type]
        cparams.type_k = cparams.type_v = int(getattr(lc, const, value))
        cparams.flash_attn_type = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                   "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}[p.flash_attn]
        _log_lines.clear()
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp failed to create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max})\n{recent_log()}")
        self.n_ctx = int(lc.llama_n_ctx(self.ctx))
        self.n_seq_max = int(n_seq_max)
        self.n_batch = int(cparams.n_batch)
        self._batch = lc.llama_batch_init(self.n_batch, 0, self.n_seq_max)
        get_mem = getattr(lc, "llama_get_memory", None)
        self._mem = get_mem(self.ctx) if get_mem is not None else None

    def _free_context(self) -> None:
        if self._batch is not None:
            self.lc.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            self.lc.llama_free(self.ctx)
            self.ctx = None

    def close(self) -> None:
        self._free_context()
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None

    def __del__(self):  # pragma: no cover - interpreter shutdown may have torn llama_cpp down already
        with contextlib.suppress(AttributeError, TypeError, OSError):
            self.close()

    # -- KV-cache sequences -----------------------------------------------------------------
    def clear(self) -> None:
        if self._mem is not None:
            self.lc.llama_memory_clear(self._mem, True)
        else:  # llama-cpp-python before the llama_memory_* API
            self.lc.llama_kv_self_clear(self.ctx)

    def seq_cp(self, src: int, dst: int) -> None:
        if self._mem is not None:
            self.lc.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        else:
            self.lc.llama_kv_self_seq_cp(self.ctx, src, dst, -1, -1)

    def seq_rm(self, seq: int) -> None:
        if self._mem is not None:
            ok = self.lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
        else:
            ok = self.lc.llama_kv_self_seq_rm(self.ctx, seq, -1, -1)
        if not ok:
            raise RuntimeError(f"llama.cpp refused to remove sequence {seq} from the KV cache")

    # -- forward ----------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               want_logits: Sequence[bool]) -> None:
        """One ``llama_decode`` of len(tokens) <= n_batch tokens (token i -> sequence seq_ids[i])."""
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"decode of {n} tokens (n_batch={self.n_batch})")
        b = self._batch
        for i in range(n):
            b.token[i] = int(tokens[i])
            b.pos[i] = int(positions[i])
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = int(seq_ids[i])
            b.logits[i] = 1 if want_logits[i] else 0
        b.n_tokens = n
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            hint = " (KV cache full: raise n_ctx)" if rc == 1 else ""
            raise RuntimeError(f"llama_decode returned {rc}{hint}\n{recent_log()}")

    def logits_view(self, i: int) -> np.ndarray:
        """Logits of batch row i of the last decode (no copy: valid until the next decode)."""
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise RuntimeError(f"llama_get_logits_ith({i}) returned NULL")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def prefill(self, ids: Sequence[int], seq: int = 0, all_logits: bool = False) -> np.ndarray:
        """Process the prompt in n_batch chunks. Returns the last position's logits (a copy), or
        with ``all_logits`` a [len(ids), n_vocab] array (teacher forcing)."""
        n = len(ids)
        if n == 0:
            raise ValueError("empty prompt")
        out = np.empty((n, self.n_vocab), dtype=np.float32) if all_logits else None
        last = None
        for s in range(0, n, self.n_batch):
            chunk = ids[s:s + self.n_batch]
            m = len(chunk)
            want = [all_logits or (s + i == n - 1) for i in range(m)]
            self.decode(chunk, range(s, s + m), [seq] * m, want)
            if all_logits:
                for i in range(m):
                    out[s + i] = self.logits_view(i)
            elif s + m == n:
                last = self.logits_view(m - 1).copy()
        return out if all_logits else last

    def greedy(self, ids: Sequence[int], max_new_tokens: int,
               on_first_token: Callable[[], None] | None = None) -> list[int]:
        """Exactly max_new_tokens argmax tokens after ids (end-of-sequence is not special)."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.clear()
        tok = int(np.argmax(self.prefill(ids)))
        out = [tok]
        if on_first_token is not None:
            on_first_token()
        pos = len(ids)
        while len(out) < max_new_tokens:
            self.decode([tok], [pos], [0], [True])
            pos += 1
            tok = int(np.argmax(self.logits_view(0)))
            out.append(tok)
        return out

    # -- facts ------------------------------------------------------------------------------
    def describe(self) -> dict:
        lc = self.lc
        buf = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self.model, buf, ctypes.sizeof(buf))
        ftype = None
        if hasattr(lc, "llama_model_ftype"):
            code = int(lc.llama_model_ftype(self.model))
            name = lc.llama_ftype_name(code) if hasattr(lc, "llama_ftype_name") else None
            ftype = name.decode() if isinstance(name, bytes) else code
        return {
            "gguf_path": str(self.path),
            "gguf_bytes": self.path.stat().st_size,
            "model_desc": buf.value.decode(errors="replace"),
            "model_ftype": ftype,
            "model_size_bytes": int(lc.llama_model_size(self.model)),
            "model_n_params": int(lc.llama_model_n_params(self.model)),
            "n_layer": self.n_layer,
            "n_vocab": self.n_vocab,
            "n_ctx": self.n_ctx,
            "n_seq_max": self.n_seq_max,
            "n_batch": self.n_batch,
            "kv_unified": True,
            "flash_attn": self.params.flash_attn,
            "kv_cache_type": self.params.kv_cache_type,
            "n_gpu_layers": self.params.n_gpu_layers,
            "n_cpu_moe": self.params.n_cpu_moe,
            "n_threads": int(lc.llama_n_threads(self.ctx)),
            "n_threads_batch": int(lc.llama_n_threads_batch(self.ctx)),
        }
