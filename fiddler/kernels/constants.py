"""The constants the kernel library and its callers share, in one place and in pure Python: importing this
needs neither torch nor the compiled library, so simulate mode, placement, the size arithmetic of the
quantized formats and the llama.cpp baseline use it on any machine.

The C++ side has the same values (csrc/fk.h, fk_internal.h, fk_quant.h) and exports them by name
(`fk_constant`, csrc/fk_api.cpp); tests/test_kernel_api.py compares `exported()` with the built library,
both ways, so neither side can change alone.
"""
from __future__ import annotations

# ------------------------------------------------------------------ paths and modes
# the vector paths (fk_internal.h Isa), ordered; "avx512": AVX-512 F without BF16 (bf16 widened, FMA on zmm)
ISA_CODES = {"generic": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3}
ISA_NAMES = {v: k for k, v in ISA_CODES.items()}
# the quantized kernel's paths use the same codes; on the AVX-512 path its integer dot products are VNNI
QUANT_ISA_CODES = {"generic": ISA_CODES["generic"], "avx2": ISA_CODES["avx2"], "avx512_vnni": ISA_CODES["avx512"]}
AMX_MODES = {"off": 0, "on": 1, "emulated": 2}  # AMX tiles: none, the hardware's, a software model of them
STREAM_HINTS = ("none", "t0", "t1", "nta")  # the weight stream's prefetch hints, codes 0..3
QUANT_MODES = {"a8": 0, "w": 1}  # quantized compute: Q8_0 activations and integer dots / fp32 activations
AMX_NEVER = 17  # a quantized min_tokens no row-group call (at most 16 tokens) reaches

# ------------------------------------------------------------------ quantized formats (llama.cpp's blocks)
QUANT_FORMATS = {"q8_0": 0, "q4_0": 1}  # format codes
QK = 32  # weights per block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}  # fp16 scale + 32 int8 / 32 nibbles (block_q8_0 / block_q4_0)

# ------------------------------------------------------------------ packed layouts (fiddler.kernels.layout)
BLOCK_N, ALIGN_K = 32, 32  # bf16: rows per packed block, K padding (one AMX tile's depth)
Q_ROWS, Q_ALIGN_K = 16, 64  # quantized: rows per row group, K padding (two blocks a unit)
Q_QUANT_BYTES = {"q8_0": 8 * 64, "q4_0": 4 * 64}  # one block's quants for a row group


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of k weights as `fmt` blocks (k padded to whole blocks)."""
    return (k + QK - 1) // QK * BLOCK_BYTES[fmt]


def matrix_bytes(rows: int, cols: int, fmt: str | None, itemsize: int = 2) -> int:
    """Bytes of a [rows, cols] weight matrix: dense at `itemsize` bytes a weight (fmt None), or `fmt` blocks."""
    return rows * cols * itemsize if fmt is None else rows * row_bytes(fmt, cols)


def bits_per_weight(fmt: str) -> float:
    return 8.0 * BLOCK_BYTES[fmt] / QK


def exported() -> dict[str, int]:
    """These constants under the names the library exports them by (fk_constant_name / fk_constant)."""
    out = {f"isa.{n}": c for n, c in ISA_CODES.items()}
    out.update({f"amx.{n}": c for n, c in AMX_MODES.items()})
    out.update({f"hint.{n}": c for c, n in enumerate(STREAM_HINTS)})
    out.update({f"qmode.{n}": c for n, c in QUANT_MODES.items()})
    out.update({"quant.amx_never": AMX_NEVER, "quant.qk": QK, "quant.rows": Q_ROWS, "quant.align_k": Q_ALIGN_K,
                "bf16.block_n": BLOCK_N, "bf16.align_k": ALIGN_K})
    for f, code in QUANT_FORMATS.items():
        out.update({f"{f}.code": code, f"{f}.block_bytes": BLOCK_BYTES[f], f"{f}.quant_bytes": Q_QUANT_BYTES[f]})
    return out
