"""The compiled CPU kernels, when they can be used here. Both are optional: without them (no compiler at
install time, an unsupported CPU, a broken build) the engine runs the same computations with torch.

One library serves every module (fiddler.kernels binds all its entry points from csrc/fk_api.h at once),
so each probe is the same question, whether it loaded, plus what the module itself needs (the prefill
attention: the avx512_bf16 path)."""

from __future__ import annotations

import functools
import importlib

#: a projection's kernel_max_tokens meaning "the kernel at every token count" (torch never serves it)
KERNEL_EVERY_COUNT = 1 << 30


def _module(name: str):
    """(fiddler.kernels[.name], None), or (None, why it did not import)."""
    try:
        return importlib.import_module(f"{__package__}.kernels{'.' + name if name else ''}"), None
    except Exception as e:  # noqa: BLE001 -- a broken build must not break the torch path
        return None, e


def load_kernels():
    """fiddler.kernels if its compiled library loaded, else None."""
    k, _ = _module("")
    return k if k is not None and k.is_available() else None


def load_decode_kernels():
    """fiddler.kernels.decode if the compiled library loaded (it has the fused decode ops), else None."""
    d, _ = _module("decode")
    return d if d is not None and d.is_available() else None


@functools.cache
def load_route_kernels():
    """fiddler.kernels.route if the compiled library loaded with it, else None (asked once: the router of every
    layer asks)."""
    r, _ = _module("route")
    return r if r is not None and r.is_available() else None


@functools.cache
def load_argmax_kernels():
    """fiddler.kernels.argmax if the compiled library loaded with it, else None (asked once: every decode
    step asks)."""
    a, _ = _module("argmax")
    return a if a is not None and a.is_available() else None


def decode_kernels_error() -> str:
    """Why load_decode_kernels() returned None."""
    d, e = _module("decode")
    if d is None:
        return f"fiddler.kernels.decode did not import: {e}"
    return d.load_error() or "fiddler.kernels.decode is not available"


def load_attention_kernel():
    """fiddler.kernels.attention if this process's kernel runs the prefill attention, else None."""
    a, _ = _module("attention")
    return a if a is not None and a.is_available() else None
