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
from pathlib import Path

import torch

QUANT_TYPES = ("q8_0", "q4_0")
QK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}  # fp16 scale + 32 int8 / 32 nibbles
CACHE_VERSION = 1  # bump when the cached content changes meaning


def check_quant(quant: str | None) -> str | None:
    """None (the model dtype) or one of QUANT_TYPES; raises ValueError otherwise."""
    if quant is None or quant in ("none", "bf16"):
        return None
    if quant not in QUANT_TYPES:
        raise ValueError(f"unknown quant type {quant!r}; choose one of {', '.join(QUANT_TYPES)} or None")
    return quant


def weight_bytes(rows: int, cols: int, quant: str | None, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a [rows, cols] weight matrix: dense in `dtype`, or llama.cpp blocks (cols padded to 32)."""
    if quant is None:
        return rows * cols * dtype.itemsize
    return rows * ((cols + QK - 1) // QK) * BLOCK_BYTES[quant]


def bits_per_weight(quant: str | None, dtype: torch.dtype = torch.bfloat16) -> float:
    return 8.0 * dtype.itemsize if quant is None else 8.0 * BLOCK_BYTES[quant] / QK


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

    kernel_max_tokens: int = 1 << 30

    def __init__(self, blocks: torch.Tensor, quant: str, out_features: int, in_features: int):
        self.packed = _kq().QuantLinear(blocks, quant, out_features, in_features)
        self.weight = None
        self.quant = quant
        self.threads: int | None = None

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
    if not all(layer.device.type == "cpu" for layer in model.layers):
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
        if layer.device.type == "cpu":
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


def cache_path(path: str | Path, quant: str, cache_dir: str | Path | None = None) -> Path:
    """Where the block bytes of checkpoint `path` at `quant` are cached: keyed by the checkpoint's
    content hash and the quant type."""
    d = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = checkpoint_hash(path, d / "hash_memo.json")
    return d / f"{digest[:20]}-{quant}-v{CACHE_VERSION}.safetensors"


def load_cache(file: Path) -> dict[str, torch.Tensor] | None:
    if not file.is_file():
        return None
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception:  # noqa: BLE001 -- a damaged cache file is rebuilt
        return None


def save_cache(file: Path, tensors: dict[str, torch.Tensor], quant: str) -> None:
    """Written to a temporary name and renamed, so a crash never leaves half a cache."""
    from safetensors.torch import save_file

    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"quant": quant})
    os.replace(tmp, file)


# ------------------------------------------------------------------ experts held as blocks
def dequantize_expert(w, quant: str, hidden: int, ffn: int, dtype: torch.dtype):
    """Dense ExpertWeights from an expert held as block bytes, on the blocks' device (the GPU side
    computes kinds a and b this way: the quantized bytes are what is stored and copied)."""
    from .weights import ExpertWeights

    return ExpertWeights(dequantize_blocks(w.w1, quant, hidden, dtype), dequantize_blocks(w.w3, quant, hidden, dtype),
                         dequantize_blocks(w.w2, quant, ffn, dtype))


def empty_expert_blocks(config, quant: str, device):
    """An uninitialised expert of block bytes (a copy buffer for kind b)."""
    from .weights import ExpertWeights

    h, f = config.hidden_size, config.intermediate_size
    rb = lambda cols: (cols + QK - 1) // QK * BLOCK_BYTES[quant]  # noqa: E731
    return ExpertWeights(torch.empty(f, rb(h), dtype=torch.uint8, device=device),
                         torch.empty(f, rb(h), dtype=torch.uint8, device=device),
                         torch.empty(h, rb(f), dtype=torch.uint8, device=device))


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
    Every such tensor must be of type `quant` (llama.cpp's pure policy: baselines/llama_cpp, quant_policy
    pure); the rest of the model is read from the checkpoint."""
    try:
        import gguf
    except ImportError as e:  # a declared dependency; a clear message if an environment lacks it
        raise RuntimeError("reading GGUF files needs the `gguf` package (pip install gguf)") from e
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    want = _GGUF_TYPES[quant]
    H, F_, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{path}: no tensor {name} (is this a GGUF of a Mixtral checkpoint?)")
        if t.tensor_type.name != want:
            raise ValueError(f"{path}: {name} is {t.tensor_type.name}, not {want}; quantize with llama.cpp's pure "
                             f"policy (python -m baselines.llama_cpp.convert MODEL --quant {quant} --pure)")
        data = torch.from_numpy(t.data.copy())
        if tuple(data.shape) != shape:
            raise ValueError(f"{path}: {name} has block shape {tuple(data.shape)}, expected {shape}")
        return data

    rb = lambda cols: (cols + QK - 1) // QK * BLOCK_BYTES[quant]  # noqa: E731
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
