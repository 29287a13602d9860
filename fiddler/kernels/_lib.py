"""The compiled kernel library (built by `pip install -e .` from csrc/), bound through ctypes from its
header: csrc/fk_api.h declares every entry point once, and `parse_header` turns those declarations into
the ctypes table here, so a new entry point needs no Python edit and no argument type is written twice.

ctypes releases the GIL for the duration of every call, so a CPU expert can run in a Python worker
thread while the main thread keeps working. The library is a plain shared object (no Python or torch
headers), so one build serves every Python version. Nothing here imports torch or the rest of the
package: scripts load this file on its own, by path (systems/llama_cpp/build_flags.py).
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
import re
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_NAME = "_fiddler_cpu"
HEADER = _HERE / "csrc" / "fk_api.h"

lib: ctypes.CDLL | None = None
load_error: str | None = None
SIGNATURES: dict[str, tuple] = {}  # name -> (restype, [argtypes]), as bound on `lib`

# The header's types and their ctypes. Pointers other than `const char*` pass addresses (c_void_p
# takes ints, None and ctypes arrays); callback typedefs (fk_*_fn) are pointers too.
SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}
C_STRING = "const char*"

_DECL = re.compile(r"FK_API\s+(?P<ret>[\w\s*]+?)\s*\b(?P<name>fk_\w+)\((?P<params>[^()]*)\);\s*(//.*)?")
_TYPEDEF = re.compile(r"typedef\s+[\w\s*]+\(\s*\*\s*(?P<name>fk_\w+_fn)\s*\)\s*\([^()]*\);\s*(//.*)?")
_PARAM = re.compile(r"(?P<type>[\w\s*]+?)\s*\b(?P<name>[A-Za-z_]\w*)")


class HeaderError(ValueError):
    """A line of fk_api.h outside the declaration form the bindings read (see the header's top)."""


def _norm(t: str) -> str:
    return re.sub(r"\s*\*", "*", " ".join(t.split()))


def _ctype(t: str, where: str, callbacks: set[str], ret: bool = False):
    t = _norm(t)
    if ret and t == "void":
        return None
    if t in SCALARS:
        return SCALARS[t]
    if t == C_STRING:
        return ctypes.c_char_p
    if t.endswith("*") or t in callbacks:
        return ctypes.c_void_p
    raise HeaderError(f"{where}: type {t!r} is not one the bindings take (see fk_api.h)")


def parse_header(text: str) -> dict[str, tuple]:
    """{name: (restype, [argtypes])} of the `FK_API` declarations in fk_api.h's text, in order. Strict:
    a line that starts with FK_API or a typedef and does not have the documented form raises HeaderError,
    as do a duplicate name and a type the table has no ctypes for."""
    callbacks: set[str] = set()
    out: dict[str, tuple] = {}
    for no, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        where = f"fk_api.h:{no}"
        if s.startswith("typedef"):
            m = _TYPEDEF.fullmatch(s)
            if not m:
                raise HeaderError(f"{where}: a typedef must be a callback `typedef R (*fk_x_fn)(...);`: {s!r}")
            callbacks.add(m["name"])
        elif s.startswith("FK_API"):
            m = _DECL.fullmatch(s)
            if not m:
                raise HeaderError(f"{where}: not a one-line `FK_API type fk_name(type arg, ...);`: {s!r}")
            name, params = m["name"], m["params"].strip()
            if name in out:
                raise HeaderError(f"{where}: {name} declared twice")
            args = []
            for p in ([] if params in ("", "void") else params.split(",")):
                pm = _PARAM.fullmatch(p.strip())
                if not pm:
                    raise HeaderError(f"{where}: parameter {p.strip()!r} of {name} needs a type and a name")
                args.append(_ctype(pm["type"], f"{where} {name}({pm['name']})", callbacks))
            out[name] = (_ctype(m["ret"], f"{where} {name}", callbacks, ret=True), args)
    if not out:
        raise HeaderError("fk_api.h declares no entry point")
    return out


def _find() -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = _HERE / f"{_NAME}{suffix}"
        if p.exists():
            return p
    return None


def library_path() -> Path | None:
    """The compiled library's file, if it is built."""
    return _find()


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
        sigs = parse_header(HEADER.read_text())
        l = ctypes.CDLL(os.fspath(path))
        for name, (res, args) in sigs.items():
            f = getattr(l, name)
            f.restype, f.argtypes = res, args
    except (OSError, HeaderError) as e:
        load_error = f"could not bind {path}: {e}"
        return
    except AttributeError as e:  # a library built before an entry point was declared
        load_error = f"{path} is older than fk_api.h ({e}); rebuild with `pip install -e .`"
        return
    SIGNATURES.update(sigs)
    lib = l


def L() -> ctypes.CDLL:
    """The loaded library; raises with why it is not available."""
    if lib is None:
        raise RuntimeError(f"fiddler.kernels unavailable: {load_error}")
    return lib


def last_error() -> str:
    return lib.fk_last_error().decode() if lib is not None else f"kernel library not loaded: {load_error}"


def check(rc: int) -> None:
    """Raises with the library's message when a call returned an error code."""
    if rc != 0:
        raise RuntimeError(f"fiddler.kernels: {last_error()}")


_load()
