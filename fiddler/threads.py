"""torch's intra-op thread count, set for a stretch of code (the engine and the model switch it)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Temporarily set torch's intra-op thread count (None: leave it)."""
    prev = torch.get_num_threads()
    if n is not None and n != prev:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None and n != prev:
            torch.set_num_threads(prev)
