"""The packed weight layouts of the CPU kernel, described once in torch: sizes, and unpacking on any device.

The CPU kernel (csrc/fk.h, csrc/fk_quant.h) packs an expert once; the engine keeps only that copy in host
memory. The GPU side receives the same packed bytes (kind b) and unpacks them here, with plain tensor
views and one copy, so its weights are bit for bit the ones that were packed. tests/test_packed_layout.py
round-trips both layouts through the C++ packer, so this description and csrc/ cannot drift apart.

bf16 (csrc/fk.h): W[n][k] in blocks of BLOCK_N rows, k padded to ALIGN_K; inside a block, for each column
pair kp, the rows' two values side by side: block[kp][row][e] = W[nb*BLOCK_N + row][2*kp + e]. `groups`
matrices of one shape (W1, W3) are interleaved block by block: packed[nb][g].

Q8_0 / Q4_0 (csrc/fk_quant.h): rows in groups of Q_ROWS, k padded to Q_ALIGN_K (two blocks); per row group
and pair of blocks one unit: 64 bytes of scales ([block][row] fp16), then per block the quants as 4-byte
columns ([block][column j][row], bytes 4j..4j+3 of the block's quants; Q8_0 stored as q + 128). `groups`
matrices are interleaved per row group: packed[rg][g].
"""

from __future__ import annotations

import torch

# the layouts' parameters, shared with the C++ side (fiddler.kernels.constants, checked against the library)
from .constants import ALIGN_K, BLOCK_N, Q_ALIGN_K, Q_QUANT_BYTES, Q_ROWS, QK
from .constants import BLOCK_BYTES as Q_BLOCK_BYTES


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def packed_bytes(n: int, k: int, groups: int, fmt: str | None = None) -> int:
    """Bytes of `groups` packed [n, k] matrices (fmt None: bf16; "q8_0" / "q4_0": llama.cpp blocks)."""
    if fmt is None:
        return _round_up(n, BLOCK_N) // BLOCK_N * groups * _round_up(k, ALIGN_K) * BLOCK_N * 2
    unit = 64 + 2 * Q_QUANT_BYTES[fmt]
    return _round_up(n, Q_ROWS) // Q_ROWS * groups * (_round_up(k, Q_ALIGN_K) // Q_ALIGN_K) * unit


def expert_packed_bytes(hidden: int, ffn: int, fmt: str | None = None) -> tuple[int, int]:
    """(w13, w2) bytes of a packed expert: W1 and W3 [ffn, hidden] interleaved, W2 [hidden, ffn]."""
    return packed_bytes(ffn, hidden, 2, fmt), packed_bytes(hidden, ffn, 1, fmt)


def unpack(packed: torch.Tensor, n: int, k: int, groups: int, fmt: str | None = None) -> list[torch.Tensor]:
    """The `groups` matrices of a packed uint8 buffer, on its device: bf16 [n, k] (views, no copy), or
    llama.cpp block bytes uint8 [n, row bytes] (new tensors: Q8_0's q + 128 is turned back into q)."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != packed_bytes(n, k, groups, fmt):
        raise ValueError(f"packed must be {packed_bytes(n, k, groups, fmt)} uint8 bytes for {groups} x [{n}, {k}] "
                         f"({fmt or 'bf16'}), got {tuple(packed.shape)} {packed.dtype}")
    if fmt is None:
        nb, kp = _round_up(n, BLOCK_N) // BLOCK_N, _round_up(k, ALIGN_K)
        v = packed.view(torch.bfloat16).view(nb, groups, kp // 2, BLOCK_N, 2)
        return [v[:, g].permute(0, 2, 1, 3).reshape(nb * BLOCK_N, kp)[:n, :k] for g in range(groups)]
    n_rg, units, qb = _round_up(n, Q_ROWS) // Q_ROWS, _round_up(k, Q_ALIGN_K) // Q_ALIGN_K, Q_QUANT_BYTES[fmt]
    nkb, cols = _round_up(k, QK) // QK, qb // (4 * Q_ROWS)  # blocks per row, 4-byte columns per block
    v = packed.view(n_rg, groups, units, 64 + 2 * qb)
    out = []
    for g in range(groups):
        scales = v[:, g, :, :64].reshape(n_rg, units, 2, Q_ROWS, 2).permute(0, 3, 1, 2, 4)  # [rg, row, u, b, 2]
        quants = v[:, g, :, 64:].reshape(n_rg, units, 2, cols, Q_ROWS, 4).permute(0, 4, 1, 2, 3, 5)
        quants = quants.reshape(n_rg * Q_ROWS, units * 2, cols * 4)
        if fmt == "q8_0":  # the kernel's unsigned operand q + 128, back to llama.cpp's int8 q
            quants = quants ^ 0x80
        blocks = torch.cat([scales.reshape(n_rg * Q_ROWS, units * 2, 2), quants], dim=-1)
        out.append(blocks[:n, :nkb].reshape(n, nkb * Q_BLOCK_BYTES[fmt]))
    return out


def unpack_into(dsts: list[torch.Tensor], packed: torch.Tensor, n: int, k: int, fmt: str | None = None) -> None:
    """Unpack into preallocated contiguous tensors, one per group (bf16 [n, k] or block bytes), e.g. the GPU
    side's copy-in scratch."""
    for dst, src in zip(dsts, unpack(packed, n, k, len(dsts), fmt), strict=True):
        dst.copy_(src)
