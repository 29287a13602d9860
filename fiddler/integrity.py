"""Checks that a file holds what it claims before its numbers are used (issue 20): content hashes for the
project's caches, and a structural check of GGUF files given by the user (which carry no checksum).

A cache that fails its check is rebuilt with a CacheRebuiltWarning naming the file and what was wrong; a
user's file that fails is an error naming the file and what is wrong.
"""
from __future__ import annotations

import hashlib
import struct
import warnings
from pathlib import Path


class CacheRebuiltWarning(UserWarning):
    """A cache entry did not hold what it claimed and is being rebuilt."""


def warn_rebuild(file: Path, problem: str, what: str) -> None:
    warnings.warn(f"{file}: {problem}; {what}", CacheRebuiltWarning, stacklevel=3)


def tensors_sha256(tensors: dict[str, "torch.Tensor"]) -> str:  # noqa: F821
    """sha256 over the tensors in name order: each one's name, dtype, shape and bytes (so a renamed,
    reshaped or retyped tensor changes it as much as a flipped bit)."""
    import torch  # here, so the baselines' use of this module does not import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------ GGUF (spec v2/v3), header only
# value type -> bytes of one scalar (8: string, 9: array are read specially)
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _Header:
    """Little-endian reads from a GGUF header, refusing to run past the end of the file."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def take(self, n: int) -> bytes:
        if n > self.size - self.f.tell():
            raise EOFError
        return self.f.read(n)

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> bytes:
        return self.take(self.u64())

    def skip(self, n: int) -> None:
        if n > self.size - self.f.tell():
            raise EOFError
        self.f.seek(n, 1)

    def value(self, vtype: int, depth: int = 0):
        """A metadata value: a scalar's bytes, a string's bytes, or None for an array (skipped)."""
        if vtype == 8:
            return self.string()
        if vtype in _GGUF_SCALAR:
            return self.take(_GGUF_SCALAR[vtype])
        if vtype != 9 or depth:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, count = self.u32(), self.u64()
        if etype in _GGUF_SCALAR:
            self.skip(count * _GGUF_SCALAR[etype])
        elif etype == 8:
            if count * 8 > self.size:  # every string needs its 8-byte length
                raise ValueError(f"an array of {count} strings cannot fit in {self.size} bytes")
            for _ in range(count):
                self.string()
        else:
            raise ValueError(f"unknown metadata array type {etype}")
        return None


def _tensor_infos(r: _Header) -> tuple[int, list]:
    """(alignment, [(name, dims, type, offset)]) from the header after its version field."""
    n_tensors, n_kv = r.u64(), r.u64()
    if n_kv * 12 > r.size:  # a key's length and a value's type take 12 bytes
        raise ValueError(f"{n_kv} metadata entries cannot fit in {r.size} bytes")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = r.string(), r.u32()
        value = r.value(vtype)
        if key == b"general.alignment" and vtype == 4:
            alignment = struct.unpack("<I", value)[0]
    if n_tensors * 24 > r.size:  # name length, dims, type and offset take at least 24 bytes each
        raise ValueError(f"{n_tensors} tensors cannot fit in {r.size} bytes")
    infos = []
    for _ in range(n_tensors):
        name = r.string().decode(errors="replace")
        n_dims = r.u32()
        if n_dims > 8:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        dims = [r.u64() for _ in range(n_dims)]
        infos.append((name, dims, r.u32(), r.u64()))
    if alignment == 0:
        raise ValueError("general.alignment is 0")
    return alignment, infos


def check_gguf_file(path: str | Path) -> None:
    """Raises ValueError("gguf=PATH: <what is wrong>") unless `path` is a GGUF file whose header reads to
    its end and whose every tensor lies within the file. The tensor bytes themselves are not checked: a
    GGUF file carries no checksum."""
    import gguf

    p = Path(path)
    fail = lambda why: ValueError(f"gguf={p}: {why}")  # noqa: E731
    if not p.is_file():
        raise fail("no such file")
    size = p.stat().st_size
    if size == 0:
        raise fail("empty file")
    with open(p, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise fail(f"not a GGUF file (bad magic {magic!r})")
        r = _Header(f, size)
        try:
            version = r.u32()
            alignment, infos = _tensor_infos(r) if version in (2, 3) else (1, [])
        except EOFError:
            raise fail(f"truncated header (the file has {size} bytes)") from None
        except ValueError as e:
            raise fail(f"damaged header ({e})") from None
        if version not in (2, 3):
            raise fail(f"GGUF version {version} is not supported (2 or 3)")
        data_start = -(-f.tell() // alignment) * alignment
    for name, dims, ttype, offset in infos:
        try:
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise fail(f"tensor {name} has unknown type {ttype}") from None
        n = 1
        for d in dims:
            n *= d
        if dims and dims[0] % block:
            raise fail(f"tensor {name}: {dims[0]} columns are not whole blocks of {block}")
        start, end = data_start + offset, data_start + offset + n // block * type_bytes
        if end > size:
            raise fail(f"truncated: tensor {name} needs bytes {start}..{end}, the file has {size}")
