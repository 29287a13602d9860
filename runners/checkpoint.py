"""Cheap start-up checks of a checkpoint: config.json (parsed, required keys) and the safetensors
files (headers and sizes only), so that a damaged or truncated download fails before any system
loads it, with the file (and key) named."""
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
    problem = _header_problem(header)
    if problem:
        raise ConfigError(f"{path}: corrupted safetensors header ({problem})")
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ConfigError(f"{path}: truncated safetensors file: the header describes {8 + n + end} bytes, "
                          f"the file has {size}")


def _header_problem(header) -> str | None:
    """Why a parsed header is not the shape read here (an object of tensor entries, each with
    data_offsets [begin, end], integers, begin <= end), or None."""
    if not isinstance(header, dict):
        return f"a JSON {type(header).__name__}, not an object"
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return f"tensor {key!r} has no data_offsets [begin, end] of integers, begin <= end"
    return None


def verify_checkpoint(directory: Path) -> None:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory}: no *.safetensors files (only safetensors checkpoints are supported)")
    for f in files:
        verify_safetensors(f)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def verify_config_json(directory: Path) -> None:
    """config.json parses, and has the keys the engine's parser requires (MoEConfig.from_dict, which
    also names the supported architectures) and those the harness reads."""
    path = Path(directory) / "config.json"
    try:
        cfg = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # ValueError: JSON and UTF-8 errors
        raise ConfigError(f"{path}: not a valid JSON file ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: not a JSON object")
    from fiddler.config import MoEConfig

    try:
        MoEConfig.from_dict(cfg)
    except KeyError as exc:
        raise ConfigError(f"{path}: required key {exc.args[0]!r} is missing") from exc
    except (TypeError, ValueError, ArithmeticError, AttributeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    for key, required in (("vocab_size", True), ("max_position_embeddings", False)):
        if (required or key in cfg) and not _positive_int(cfg.get(key)):
            raise ConfigError(f"{path}: {key}={cfg.get(key)!r} is invalid; allowed: an integer >= 1")
