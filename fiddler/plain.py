"""Stats and facts as plain Python values (JSON-able): the one converter the engine's stats and info and the
harness's records use."""

from __future__ import annotations

from enum import Enum


def plain(x):
    """dicts (keys as str), lists and tuples (as lists), tensors and numpy values (tolist/item), Enums (their
    value), anything else as is."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, Enum):
        return x.value
    if hasattr(x, "tolist"):  # torch tensors, numpy arrays and scalars
        return x.tolist()
    return x
