"""The kernel's run-time settings: which ISA path and AMX use, thread count, the weight stream's prefetch,
the many-token blocking, and what the CPU has (`features()`). The tuners that measure some of them are
in tuning.py."""
from __future__ import annotations

import ctypes

from . import _lib
from .constants import AMX_MODES, ISA_CODES, ISA_NAMES, STREAM_HINTS

_L, check = _lib.L, _lib.check
HINTS = STREAM_HINTS  # codes 0..3 of the C library
_AMX_CHOICE: dict = {"source": "default"}  # how amx_min_tokens was set (amx_choice())
_BLOCKING_CHOICE: dict = {"source": "default"}  # how the super-blocks were set (blocking_choice())


def is_available() -> bool:
    """Whether the compiled library loaded (it is built by `pip install -e .`)."""
    return _lib.lib is not None


def load_error() -> str | None:
    """Why the library is not available, or None."""
    return _lib.load_error


# ------------------------------------------------------------------ ISA selection and AMX
def set_isa(name: str | None = None) -> str:
    """Selects the kernel path: None/"auto" (best for this CPU), "amx" (AVX512-BF16 with AMX tiles from
    the default amx_min_tokens up; error without AMX), "avx512_bf16" (no AMX), "avx512" (AVX-512 F: bf16 widened to
    fp32, FMA on zmm), "avx2", "generic". Returns `isa()`."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        rc = _L().fk_configure(-1, -1, 0)
    elif name == "amx":
        rc = _L().fk_configure(ISA_CODES["avx512_bf16"], AMX_MODES["on"], 0)
    elif name in ISA_CODES:
        rc = _L().fk_configure(ISA_CODES[name], AMX_MODES["off"], 0)
    else:
        raise ValueError(f"unknown kernel ISA {name!r}; choose one of auto, amx, avx512_bf16, avx512, avx2, generic")
    if rc != 0:
        raise ValueError(f"cannot select kernel ISA {name!r}: {_lib.last_error()}")
    _AMX_CHOICE.clear()
    _AMX_CHOICE["source"] = "default"
    return isa()


def set_amx(mode: str, min_tokens: int | None = None, source: str = "set_amx") -> None:
    """For tests and experiments: AMX tiles "off", "on" (hardware) or "emulated" (software tiles, any
    CPU), used from `min_tokens` tokens up (None: the default). Keeps the current vector path;
    `set_isa()` restores the defaults."""
    check(_L().fk_configure(_L().fk_isa(), AMX_MODES[mode], int(min_tokens or 0)))
    _AMX_CHOICE.clear()
    _AMX_CHOICE.update(source=source if min_tokens else "default")


def amx_choice() -> dict:
    """{"min_tokens", "source"} (+ "ms": {tokens: (amx, vector)} when tune_amx measured it), or
    {"min_tokens": None, "source": why not} where AMX is not in use."""
    if _L().fk_amx_mode() != AMX_MODES["on"]:
        return {"min_tokens": None, "source": "AMX not in use"}
    return {"min_tokens": int(_L().fk_amx_min_tokens()), **_AMX_CHOICE}


def isa() -> str:
    """The active vector path: "avx512_bf16", "avx512", "avx2" or "generic" (AMX use: see `features()`)."""
    return ISA_NAMES[_L().fk_isa()]


def features() -> dict:
    """CPU features seen by the library and which kernel paths are compiled and active."""
    L = _L()
    out = {L.fk_feature_name(i).decode(): bool(L.fk_feature(i)) for i in range(L.fk_num_features())}
    x86 = bool(L.fk_compiled_x86())
    amx = L.fk_amx_mode()
    out.update(
        compiled=["generic", "avx2", "avx512", "avx512_bf16", "amx"] if x86 else ["generic"],
        best_isa=ISA_NAMES[L.fk_best_isa()],
        isa=isa(),
        amx_supported=bool(L.fk_amx_supported()),
        amx_active=amx == AMX_MODES["on"],
        amx_emulated=amx == AMX_MODES["emulated"],
        amx_min_tokens=L.fk_amx_min_tokens(),
        amx_min_tokens_source=_AMX_CHOICE.get("source"),
        amx_status=L.fk_amx_status().decode(),
        stream=stream(),
        blocking=blocking(),
        blocking_source=_BLOCKING_CHOICE.get("source"),
    )
    return out


# ------------------------------------------------------------------ threads
def set_num_threads(n: int | None) -> None:
    """Default thread count of every kernel call (a call's `threads=` overrides it); None: back to
    all the CPUs this process may run on."""
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"thread count must be a positive int or None, got {n!r}")
    _L().fk_set_num_threads(n or 0)


def get_num_threads() -> int:
    """Default thread count: set_num_threads' value, else the CPUs this process may run on."""
    return _L().fk_get_num_threads()


def _threads(threads) -> int:
    if threads is None:
        return 0
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be None or a positive int, got {threads!r}")
    return threads


# ------------------------------------------------------------------ many-token blocking
def set_super_blocks(n: int | dict[int, int] | None, source: str = "set_super_blocks") -> None:
    """Weight blocks (32 rows each) a many-token product walks K with, per pool item: one int for every
    call, {tokens: n} for calls of up to that many token rows (the largest entry also serves more), or
    None for the default (8). Results do not depend on it (the same bits for every blocking)."""
    table = {} if not n else ({1 << 62: n} if not isinstance(n, dict) else dict(sorted(n.items())))
    for t, v in table.items():
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64 or not isinstance(t, int) or t < 1:
            raise ValueError(f"super-blocks must be None, an int in 1..64 or {{tokens: int in 1..64}}, got {n!r}")
    rows = (ctypes.c_int64 * max(1, len(table)))(*table.keys())
    vals = (ctypes.c_int64 * max(1, len(table)))(*table.values())
    check(_L().fk_set_super_blocks(rows, vals, len(table)))
    _BLOCKING_CHOICE.clear()
    _BLOCKING_CHOICE.update(source=source if table else "default", set=n or None)


def super_blocks_for(tokens: int) -> int:
    """The super-blocks a product of `tokens` token rows uses."""
    return int(_L().fk_super_blocks_for(int(tokens)))


def blocking_choice() -> dict:
    """{"super_blocks": {tokens: n} (measured or set per token count) or n, "source"} (+ "ms":
    {super_blocks: {tokens: ms}} when tune_blocking measured it)."""
    sb = _BLOCKING_CHOICE.get("set") or super_blocks_for(1 << 62)
    return {"super_blocks": sb, **{k: v for k, v in _BLOCKING_CHOICE.items() if k != "set"}}


def blocking(l1d: int = 0, l2: int = 0) -> dict:
    """The blocking of many-token products (more rows than one micro-kernel call takes), derived from the
    cache sizes of this CPU with the super-blocks set here (set_super_blocks, tune_blocking), or of the
    given ones (both > 0) with the default super-blocks: {"k_chunk", "token_chunk", "super_blocks",
    "l1d", "l2"}. Results do not depend on it (the same bits for every blocking)."""
    out = (ctypes.c_int64 * 5)()
    _L().fk_blocking(int(l1d), int(l2), out)
    return dict(zip(("k_chunk", "token_chunk", "super_blocks", "l1d", "l2"), (int(v) for v in out)))


# ------------------------------------------------------------------ weight-stream prefetch
def stream() -> dict:
    """The weight stream's active prefetch: {"hint", "distance", "far", "spec", "source"} (far: the
    L2 prefetch's distance, 0 for none; spec: the set_stream() form; source: the per-vendor table,
    FIDDLER_KERNEL_STREAM, tune_stream() or set_stream())."""
    L = _L()
    hint, dist, far = HINTS[L.fk_stream_hint()], int(L.fk_stream_distance()), int(L.fk_stream_far())
    return {"hint": hint, "distance": dist, "far": far, "spec": f"{hint}:{dist}" + (f"/{far}" if far else ""),
            "source": L.fk_stream_source().decode()}


def set_stream(spec: str | None = None, source: str = "set_stream") -> dict:
    """Sets the weight stream's prefetch: "HINT[:DISTANCE][/FAR]" with HINT one of none, t0, t1, nta,
    DISTANCE in bytes (a multiple of 64, default 4096) and FAR the distance of a second prefetch into
    L2 (default none), e.g. "t0:1024/4096"; "auto"/None for this CPU's default, or "tune" to measure
    the candidates here (tune_stream). Returns `stream()`."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        check(_L().fk_set_stream(-1, 0, 0, None))
        return stream()
    if spec == "tune":
        from .tuning import tune_stream

        tune_stream()
        return stream()
    near, _, far_s = spec.partition("/")
    hint, _, dist = near.partition(":")
    if hint not in HINTS:
        raise ValueError(f"unknown stream prefetch {spec!r}: use HINT[:BYTES][/FAR_BYTES] with HINT in "
                         f"{', '.join(HINTS)}, or auto, or tune")
    try:
        distance = int(dist) if dist else 4096
        far = int(far_s) if far_s else 0
    except ValueError:
        raise ValueError(f"stream prefetch distances must be int numbers of bytes, got {spec!r}") from None
    if _L().fk_set_stream(HINTS.index(hint), distance, far, source.encode()) != 0:
        raise ValueError(f"cannot set stream prefetch {spec!r}: {_lib.last_error()}")
    return stream()
