"""Cheap start-up check of a checkpoint's safetensors files (headers and sizes only), so that a
truncated or corrupted download fails before any system loads it, with the file named."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from runners.schema import ConfigError


def verify_safetensors(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path}: corrupted safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise ConfigError(f"{path}: corrupted safetensors file (header length {n} > file size {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ConfigError(f"{path}: corrupted safetensors header ({exc})") from exc
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ConfigError(f"{path}: truncated safetensors file: the header describes {8 + n + end} bytes, "
                          f"the file has {size}")


def verify_checkpoint(directory: Path) -> None:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory}: no *.safetensors files (only safetensors checkpoints are supported)")
    for f in files:
        verify_safetensors(f)
