"""The compiled CPU kernels, when they can be used here. Both are optional: without them (no compiler at
install time, an unsupported CPU, a broken build) the engine runs the same computations with torch."""

from __future__ import annotations


def load_kernels():
    """fiddler.kernels if its compiled library loaded, else None."""
    try:
        from . import kernels
    except Exception:  # noqa: BLE001 -- a broken build must not break the torch path
        return None
    return kernels if kernels.is_available() else None


def load_decode_kernels():
    """fiddler.kernels.decode if the compiled library has the fused decode ops, else None."""
    try:
        from .kernels import decode
    except Exception:  # noqa: BLE001 -- a broken build must not break the torch path
        return None
    return decode if decode.is_available() else None


def decode_kernels_error() -> str:
    """Why load_decode_kernels() returned None."""
    try:
        from .kernels import decode
    except Exception as e:  # noqa: BLE001
        return f"fiddler.kernels.decode did not import: {e}"
    return decode.load_error() or "fiddler.kernels.decode is not available"


def load_attention_kernel():
    """fiddler.kernels.attention if this process's kernel runs the prefill attention, else None."""
    try:
        from .kernels import attention
    except Exception:  # noqa: BLE001 -- a broken build must not break the torch path
        return None
    return attention if attention.is_available() else None
