"""Quantized experts and attention projections (llama.cpp's Q8_0 / Q4_0), for the engine.

`quant="q8_0" | "q4_0"` quantizes every expert's w1/w3/w2 and every layer's q/k/v/o projections with
llama.cpp's round-to-nearest quantizer (fiddler.kernels.quant.quantize, bit-identical to ggml's
quantize_row_q8_0_ref / quantize_row_q4_0_ref); embeddings, norms, router and lm_head stay in the
model dtype. The block bytes are what a GGUF file of those types holds, so the engine can also read
them from one (`load_gguf_blocks`), and what crosses PCIe for a copied-in expert (decision kind b),
dequantized on the GPU side.

Byte counts for placement, the latency model and decode bounds come from `weight_bytes` (through
MoEConfig's size methods).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .integrity import check_gguf_file, tensors_sha256, warn_rebuild
from .kernel_loader import KERNEL_EVERY_COUNT
from .kernels import constants as kc
from .kernels.constants import BLOCK_BYTES, QK  # noqa: F401 -- llama.cpp's block sizes, shared with the kernel

QUANT_TYPES = tuple(kc.QUANT_FORMATS)
CACHE_VERSION = 1  # bump when the cached content changes meaning
CACHE_FORMAT = "fiddler-quant"  # the cache files' metadata "format"


def check_quant(quant: str | None) -> str | None:
    """None (the model dtype) or one of QUANT_TYPES; raises ValueError otherwise."""
    if quant is None or quant in ("none", "bf16"):
        return None
    if quant not in QUANT_TYPES:
        raise ValueError(f"unknown quant type {quant!r}; choose one of {', '.join(QUANT_TYPES)} or None")
    return quant


def weight_bytes(rows: int, cols: int, quant: str | None, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a [rows, cols] weight matrix: dense in `dtype`, or llama.cpp blocks (cols padded to 32)."""
    return kc.matrix_bytes(rows, cols, quant, dtype.itemsize)


def row_bytes(cols: int, quant: str) -> int:
    """Block bytes of one row of `cols` weights (padded to whole blocks)."""
    return kc.row_bytes(quant, cols)


def bits_per_weight(quant: str | None, dtype: torch.dtype = torch.bfloat16) -> float:
    return 8.0 * dtype.itemsize if quant is None else kc.bits_per_weight(quant)


# ------------------------------------------------------------------ quantizing a loaded model
def _kq():
    from .kernel_loader import load_kernels

    if load_kernels() is None:
        raise RuntimeError("quantized weights need the compiled CPU kernel library (fiddler.kernels)")
    from .kernels import quant as kq

    return kq


def quantize_blocks(w: torch.Tensor, quant: str) -> torch.Tensor:
    """llama.cpp block bytes uint8 [rows, row bytes] of w [rows, cols]."""
    return _kq().quantize(w, quant)


def dequantize_blocks(blocks: torch.Tensor, quant: str, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense weights of llama.cpp blocks on blocks' device (the GPU side of kinds a and b)."""
    from .kernels.quant import dequantize

    return dequantize(blocks, quant, cols, dtype)


class QuantizedLinear:
    """Drop-in for fiddler.model.Linear on quantized weights (the CPU kernel at every token count)."""

    kernel_max_tokens: int = KERNEL_EVERY_COUNT

    def __init__(self, blocks: torch.Tensor, quant: str, out_features: int, in_features: int):
        self.packed = _kq().QuantLinear(blocks, quant, out_features, in_features)
        self.weight = None
        self.quant = quant
        self.threads: int | None = None

    def packed_threads(self) -> int:
        """The thread count the kernel's call takes (0: the library's default), as fiddler.model.Linear's."""
        return self.threads or 0

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None):
        # fp32 x (MoETransformer.fp32_quant_acts) gives the model dtype back unless asked otherwise
        if out_dtype is None:
            out_dtype = out.dtype if out is not None else torch.bfloat16
        return self.packed.forward(x, out=out, threads=self.threads, out_dtype=out_dtype)


def quantize_experts(experts, quant: str, cache: dict[str, torch.Tensor] | None = None, pin: bool = False):
    """experts [layer][expert] ExpertWeights (dense) -> ExpertWeights of block bytes, in place of the dense
    ones (freed expert by expert). `cache`: tensors by name ("l{l}.e{e}.w1", ...) to take instead of
    quantizing; filled with what was quantized. pin: page-locked host copies (CUDA copies them in)."""
    from .weights import ExpertWeights

    for l, layer in enumerate(experts):
        for e, w in enumerate(layer):
            names = [f"l{l}.e{e}.{n}" for n in ("w1", "w3", "w2")]
            if cache is not None and all(n in cache for n in names):
                blocks = [cache[n] for n in names]
            else:
                blocks = [quantize_blocks(t, quant) for t in (w.w1, w.w3, w.w2)]
                if cache is not None:
                    cache.update(zip(names, blocks))
            layer[e] = ExpertWeights(*(b.pin_memory() if pin else b for b in blocks))
    return experts


def quantize_attention(weights, quant: str, cache: dict[str, torch.Tensor] | None = None):
    """Per layer {"qkv": blocks of the fused [q; k; v], "o": blocks of o}, from dense LayerWeights or the cache."""
    out = []
    for l, lw in enumerate(weights.layers):
        names = (f"l{l}.qkv", f"l{l}.o")
        if cache is not None and all(n in cache for n in names):
            out.append({"qkv": cache[names[0]], "o": cache[names[1]]})
            continue
        qkv = quantize_blocks(torch.cat([lw.q, lw.k, lw.v]), quant)
        o = quantize_blocks(lw.o, quant)
        out.append({"qkv": qkv, "o": o})
        if cache is not None:
            cache.update({names[0]: qkv, names[1]: o})
    return out


def check_attention(cfg) -> None:
    """Quantized attention is implemented for a fused, bias-free GQA q/k/v projection (Mixtral, Qwen3-MoE,
    OLMoE); raises UnsupportedModelError naming what else a model has."""
    from .config import UnsupportedModelError

    if cfg.attention != "gqa":
        raise UnsupportedModelError(f"quantized weights: {cfg.model_type}'s {cfg.attention.upper()} attention "
                                    f"is not implemented for quant= (GQA attention without biases is)")
    if cfg.qkv_bias or cfg.o_bias:
        raise UnsupportedModelError(f"quantized weights: {cfg.model_type}'s attention biases are not "
                                    f"implemented for quant= (GQA attention without biases is)")


def use_fp32_activations(model) -> bool:
    """With every layer's projections on the CPU kernel (quantized by install_attention), feed them fp32
    activations as llama.cpp does: the RMSNorm outputs stay fp32 into q/k/v and the experts (quantized to
    Q8_0 from fp32, not from bf16, so near-amax values round as llama.cpp's do), and the router runs in fp32
    on them (llama.cpp's ffn_gate_inp is f32). Call before the engine finalises its linears (the router's
    dense weight is still there). Returns whether it was switched on."""
    if any(layer.on_gpu for layer in model.layers):
        return False  # a GPU layer computes attention in torch on dequantized bf16 weights
    model.fp32_quant_acts = True
    for layer in model.layers:
        # the layer norms' weights in fp32 once (rms_norm_f32 applies them in fp32); the final norm stays bf16
        layer.input_norm, layer.post_norm = layer.input_norm.float(), layer.post_norm.float()
        if layer.router is not None:
            layer.router_fp32, layer.router = layer.router.weight.float(), None
    return True


def install_attention(model, blocks: list[dict], quant: str) -> None:
    """Replace each layer's qkv and o projections of a built MoETransformer by quantized ones."""
    from .model import Linear

    cfg = model.cfg
    nh, nkv, d, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    for layer, b in zip(model.layers, blocks):
        if not layer.on_gpu:
            layer.qkv_proj = QuantizedLinear(b["qkv"], quant, (nh + 2 * nkv) * d, H)
            layer.o_proj = QuantizedLinear(b["o"], quant, H, nh * d)
        else:  # a GPU computes attention in torch: dequantize once onto it (same weights)
            layer.qkv_proj = Linear(dequantize_blocks(b["qkv"], quant, H, model.dtype).to(layer.device), use_kernel=False)
            layer.o_proj = Linear(dequantize_blocks(b["o"], quant, nh * d, model.dtype).to(layer.device), use_kernel=False)


# ------------------------------------------------------------------ the on-disk cache
def default_cache_dir() -> Path:
    base = os.environ.get("FIDDLER_CACHE")
    if base:
        return Path(base).expanduser() / "quant"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fiddler" / "quant"


def checkpoint_hash(path: str | Path, memo: str | Path | None = None) -> str:
    """sha256 of the names and contents of a checkpoint directory's files, remembered in `memo` per
    (name, size, mtime) so a multi-GiB checkpoint is read once (the quant cache and the llama.cpp
    baseline's GGUF cache key on it)."""
    root = Path(path)
    memo = Path(memo) if memo is not None else None
    files = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    known: dict = {}
    if memo is not None and memo.is_file():
        try:
            known = json.loads(memo.read_text())
        except (OSError, ValueError):
            known = {}
        hit = known.get(str(root.resolve()))
        if isinstance(hit, dict) and hit.get("files") == stamp:
            return hit["sha256"]
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        h.update(b"\0")
    digest = h.hexdigest()
    if memo is not None:
        known[str(root.resolve())] = {"files": stamp, "sha256": digest}
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(memo.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, memo)
    return digest


@dataclass(frozen=True)
class CacheEntry:
    """A quant cache file and what it must hold: `quant` blocks made from the checkpoint whose full
    content hash is `checkpoint`."""

    file: Path
    quant: str
    checkpoint: str


def cache_entry(path: str | Path, quant: str, cache_dir: str | Path | None = None) -> CacheEntry:
    """Where the block bytes of checkpoint `path` at `quant` are cached: keyed by the checkpoint's
    content hash and the quant type."""
    d = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = checkpoint_hash(path, d / "hash_memo.json")
    return CacheEntry(d / f"{digest[:20]}-{quant}-v{CACHE_VERSION}.safetensors", quant, digest)


def cache_path(path: str | Path, quant: str, cache_dir: str | Path | None = None) -> Path:
    return cache_entry(path, quant, cache_dir).file


def expected_block_shapes(weights, quant: str) -> dict[str, tuple[int, int]]:
    """The cache's tensor names and block shapes for these dense weights: what quantize_experts and
    quantize_attention make of them."""
    blocks = lambda w: (w.shape[0], row_bytes(w.shape[1], quant))  # noqa: E731
    out = {}
    for l, layer in enumerate(weights.experts):
        for e, w in enumerate(layer):
            out.update({f"l{l}.e{e}.w1": blocks(w.w1), f"l{l}.e{e}.w3": blocks(w.w3), f"l{l}.e{e}.w2": blocks(w.w2)})
    for l, lw in enumerate(weights.layers):
        out[f"l{l}.qkv"] = (lw.q.shape[0] + lw.k.shape[0] + lw.v.shape[0], row_bytes(lw.q.shape[1], quant))
        out[f"l{l}.o"] = blocks(lw.o)
    return out


def read_cache_metadata(file: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return f.metadata() or {}


def _metadata_problem(meta: dict[str, str], entry: CacheEntry) -> str | None:
    if meta.get("format") != CACHE_FORMAT or "sha256" not in meta:
        return "no content hash (written before caches were verified, or not a quant cache)"
    if meta.get("version") != str(CACHE_VERSION):
        return f"format version {meta.get('version')}, expected {CACHE_VERSION}"
    if meta.get("quant") != entry.quant:
        return f"holds {meta.get('quant')} blocks, expected {entry.quant}"
    if meta.get("checkpoint") != entry.checkpoint:
        return f"made from checkpoint {meta.get('checkpoint', '?')[:16]}..., expected {entry.checkpoint[:16]}..."
    return None


def _read_verified(entry: CacheEntry, shapes: dict[str, tuple[int, int]]):
    """(tensors, None) when the file holds exactly what its entry and `shapes` say, else (None, what is wrong).
    Metadata and shapes are checked before any tensor is read."""
    from safetensors import safe_open

    with safe_open(str(entry.file), "pt") as f:
        meta = f.metadata() or {}
        problem = _metadata_problem(meta, entry)
        if problem:
            return None, problem
        names = set(f.keys())
        if names != set(shapes):
            missing, extra = sorted(set(shapes) - names), sorted(names - set(shapes))
            return None, f"tensors missing: {missing[:3]}, unexpected: {extra[:3]}"
        for name in sorted(names):
            sl = f.get_slice(name)
            if sl.get_dtype() != "U8" or tuple(sl.get_shape()) != shapes[name]:
                return None, f"{name} is {sl.get_dtype()} {sl.get_shape()}, expected uint8 {list(shapes[name])}"
        tensors = {name: f.get_tensor(name) for name in sorted(names)}
    digest = tensors_sha256(tensors)
    if digest != meta["sha256"]:
        return None, f"content sha256 {digest[:16]}..., recorded {meta['sha256'][:16]}...: the file is damaged"
    return tensors, None


def load_cache(entry: CacheEntry, shapes: dict[str, tuple[int, int]]):
    """(blocks by name, None) from a sound cache file; (None, None) when there is none; (None, what is wrong)
    with a CacheRebuiltWarning naming the file when it fails a check (the caller quantizes again)."""
    if not entry.file.is_file():
        return None, None
    try:
        tensors, problem = _read_verified(entry, shapes)
    except Exception as e:  # noqa: BLE001 -- safetensors' errors for a truncated or garbled file
        tensors, problem = None, f"unreadable ({type(e).__name__}: {e})"
    if problem:
        warn_rebuild(entry.file, problem, "quantizing again and rewriting it")
    return tensors, problem


def save_cache(entry: CacheEntry, tensors: dict[str, torch.Tensor]) -> None:
    """With its metadata and content hash (checked by load_cache); written to a temporary name and renamed,
    so a crash never leaves half a cache."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta = {"format": CACHE_FORMAT, "version": str(CACHE_VERSION), "quant": entry.quant,
            "checkpoint": entry.checkpoint, "sha256": tensors_sha256(tensors)}
    entry.file.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.file.with_name(entry.file.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, entry.file)


# ------------------------------------------------------------------ experts held as blocks
def dequantize_expert(w, quant: str, hidden: int, ffn: int, dtype: torch.dtype):
    """Dense ExpertWeights from an expert held as block bytes, on the blocks' device (the GPU side
    computes kinds a and b this way: the quantized bytes are what is stored and copied)."""
    from .weights import ExpertWeights

    return ExpertWeights(dequantize_blocks(w.w1, quant, hidden, dtype), dequantize_blocks(w.w3, quant, hidden, dtype),
                         dequantize_blocks(w.w2, quant, ffn, dtype))


def pack_expert(w, quant: str, hidden: int, ffn: int):
    """The CPU kernel's packed copy of an expert held as block bytes (fiddler.kernels.quant.QuantExpert)."""
    return _kq().QuantExpert(w.w1, w.w3, w.w2, quant, hidden, ffn)


# ------------------------------------------------------------------ GGUF
_GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0"}


def _unpermute_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of q/k rows (per head, the two rope halves interleaved
    row by row: HF row h*d + i*(d/2) + j is GGUF row h*d + 2j + i). Rows are whole blocks, so block bytes
    permute like weights."""
    n, rb = rows.shape
    return rows.reshape(n_head, n // n_head // 2, 2, rb).transpose(1, 2).reshape(n, rb).contiguous()


def load_gguf_blocks(path: str | Path, cfg, quant: str) -> dict[str, torch.Tensor]:
    """The expert and attention projection blocks of a Mixtral/llama GGUF file (llama.cpp's converter +
    quantizer output), under the cache's names ("l{l}.e{e}.w1", "l{l}.qkv", ...), in HF row order.
    Every such tensor must be of type `quant` (llama.cpp's pure policy: systems/llama_cpp, quant_policy
    pure); the rest of the model is read from the checkpoint."""
    try:
        import gguf
    except ImportError as e:  # a declared dependency; a clear message if an environment lacks it
        raise RuntimeError("reading GGUF files needs the `gguf` package (pip install gguf)") from e
    check_gguf_file(path)  # a damaged file fails naming itself and what is wrong
    try:
        tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    except Exception as e:  # noqa: BLE001 -- what the header check does not cover, still named
        raise ValueError(f"gguf={path}: unreadable ({type(e).__name__}: {e})") from e
    want = _GGUF_TYPES[quant]
    H, F_, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{path}: no tensor {name} (is this a GGUF of a Mixtral checkpoint?)")
        if t.tensor_type.name != want:
            raise ValueError(f"{path}: {name} is {t.tensor_type.name}, not {want}; quantize with llama.cpp's pure "
                             f"policy (python -m systems.llama_cpp.convert MODEL --quant {quant} --pure)")
        data = torch.from_numpy(t.data.copy())
        if tuple(data.shape) != shape:
            raise ValueError(f"{path}: {name} has block shape {tuple(data.shape)}, expected {shape}")
        return data

    rb = lambda cols: row_bytes(cols, quant)  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    for l in range(cfg.num_layers):
        p = f"blk.{l}"
        q = _unpermute_rows(get(f"{p}.attn_q.weight", (nh * d, rb(H))), nh)
        k = _unpermute_rows(get(f"{p}.attn_k.weight", (nkv * d, rb(H))), nkv)
        v = get(f"{p}.attn_v.weight", (nkv * d, rb(H)))
        out[f"l{l}.qkv"] = torch.cat([q, k, v]).contiguous()
        out[f"l{l}.o"] = get(f"{p}.attn_output.weight", (H, rb(nh * d)))
        gate = get(f"{p}.ffn_gate_exps.weight", (E, F_, rb(H)))
        up = get(f"{p}.ffn_up_exps.weight", (E, F_, rb(H)))
        down = get(f"{p}.ffn_down_exps.weight", (E, H, rb(F_)))
        for e in range(E):
            out[f"l{l}.e{e}.w1"] = gate[e].contiguous()
            out[f"l{l}.e{e}.w3"] = up[e].contiguous()
            out[f"l{l}.e{e}.w2"] = down[e].contiguous()
    return out
