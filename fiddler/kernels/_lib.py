"""Loads the compiled kernel library (built by `pip install -e .` from csrc/) through ctypes.

ctypes releases the GIL for the duration of every call, so a CPU expert can run in a Python worker
thread while the main thread keeps working. Nothing here imports torch.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_NAME = "_fiddler_cpu"

lib: ctypes.CDLL | None = None
load_error: str | None = None


def _find() -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = _HERE / f"{_NAME}{suffix}"
        if p.exists():
            return p
    return None


def _declare(l: ctypes.CDLL) -> None:
    c = ctypes
    sigs = {
        "fk_last_error": (c.c_char_p, []),
        "fk_configure": (c.c_int, [c.c_int, c.c_int, c.c_int]),
        "fk_isa": (c.c_int, []),
        "fk_amx_mode": (c.c_int, []),
        "fk_amx_min_tokens": (c.c_int, []),
        "fk_amx_status": (c.c_char_p, []),
        "fk_num_features": (c.c_int, []),
        "fk_feature_name": (c.c_char_p, [c.c_int]),
        "fk_feature": (c.c_int, [c.c_int]),
        "fk_best_isa": (c.c_int, []),
        "fk_amx_supported": (c.c_int, []),
        "fk_compiled_x86": (c.c_int, []),
        "fk_set_num_threads": (None, [c.c_int]),
        "fk_get_num_threads": (c.c_int, []),
        "fk_parallel_for": (None, [c.c_int, c.c_int64, c.c_void_p, c.c_void_p]),
        "fk_packed_bytes": (c.c_int64, [c.c_int64, c.c_int64, c.c_int]),
        "fk_advise_hugepages": (None, [c.c_void_p, c.c_int64]),
        "fk_pack": (c.c_int, [c.POINTER(c.c_void_p), c.c_int, c.c_int64, c.c_int64, c.c_void_p, c.c_int]),
        "fk_expert_ffn": (
            c.c_int,
            [c.c_void_p, c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_int],
        ),
        "fk_moe_ffn": (
            c.c_int,
            [c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_int64, c.c_int64, c.c_void_p, c.c_int64,
             c.c_void_p, c.c_int],
        ),
        "fk_linear": (
            c.c_int,
            [c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_int, c.c_int],
        ),
        "fk_qpacked_bytes": (c.c_int64, [c.c_int, c.c_int64, c.c_int64, c.c_int]),
        "fk_qpack": (c.c_int, [c.c_int, c.POINTER(c.c_void_p), c.c_int, c.c_int64, c.c_int64, c.c_void_p, c.c_int]),
        "fk_qunpack": (c.c_int, [c.c_int, c.c_void_p, c.c_int, c.c_int, c.c_int64, c.c_int64, c.c_void_p]),
        "fk_quantize_rows": (c.c_int, [c.c_int, c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int]),
        "fk_qlinear": (
            c.c_int,
            [c.c_int, c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int, c.c_int64, c.c_void_p, c.c_void_p,
             c.c_int, c.c_int],
        ),
        "fk_qexpert_ffn": (
            c.c_int,
            [c.c_int, c.c_void_p, c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int, c.c_int64, c.c_void_p,
             c.c_int],
        ),
        "fk_qmoe_ffn": (
            c.c_int,
            [c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_int64, c.c_int64, c.c_void_p, c.c_int,
             c.c_int64, c.c_void_p, c.c_int],
        ),
        "fk_set_qmode": (c.c_int, [c.c_int, c.c_int]),
        "fk_qmode": (c.c_int, []),
        "fk_qisa": (c.c_int, []),
        "fk_qmode_source": (c.c_char_p, []),
        "fk_set_qamx": (c.c_int, [c.c_int, c.c_int, c.c_int]),
        "fk_qamx": (c.c_int, []),
        "fk_qamx_min_tokens": (c.c_int, [c.c_int]),
        "fk_qamx_status": (c.c_char_p, []),
        "fk_read_bandwidth": (c.c_double, [c.c_void_p, c.c_int64, c.c_int, c.c_int, c.c_int64, c.c_int]),
        "fk_set_stream": (c.c_int, [c.c_int, c.c_int64, c.c_int64, c.c_char_p]),
        "fk_stream_far": (c.c_int64, []),
        "fk_stream_hint": (c.c_int, []),
        "fk_stream_distance": (c.c_int64, []),
        "fk_stream_source": (c.c_char_p, []),
        "fk_blocking": (None, [c.c_int64, c.c_int64, c.POINTER(c.c_int64)]),
        "fk_set_super_blocks": (c.c_int, [c.POINTER(c.c_int64), c.POINTER(c.c_int64), c.c_int]),
        "fk_super_blocks_for": (c.c_int64, [c.c_int64]),
    }
    for name, (res, args) in sigs.items():
        f = getattr(l, name)
        f.restype = res
        f.argtypes = args


def _load() -> None:
    global lib, load_error
    path = _find()
    if path is None:
        load_error = (
            f"the compiled kernel library ({_NAME}*.so) is missing from {_HERE}; "
            "install the project with `pip install -e .` (it compiles fiddler/kernels/csrc)"
        )
        return
    try:
        l = ctypes.CDLL(os.fspath(path))
        _declare(l)
    except (OSError, AttributeError) as e:  # stale or foreign build
        load_error = f"could not load {path}: {e}; rebuild with `pip install -e .`"
        return
    lib = l


def check(rc: int) -> None:
    """Raises with the library's message when a call returned an error code."""
    if rc != 0:
        msg = lib.fk_last_error().decode() if lib is not None else "kernel library not loaded"
        raise RuntimeError(f"fiddler.kernels: {msg}")


_load()
