"""CPU kernels for Fiddler's CPU expert path: a fused expert FFN y = W2 (silu(W1 x) * (W3 x)) and a
plain linear layer on bf16 weights with fp32 accumulation (C++, see csrc/).

Weights are packed once (`PackedExpert`, `PackedLinear`) into a layout that streams contiguously;
every call reads each weight byte once whatever the token count. The instruction set is chosen at run
time from the CPU: AVX512-BF16 (plus AMX tiles for many tokens where the CPU has AMX), else AVX2/FMA,
else portable C++. `FIDDLER_KERNEL_ISA` (auto, amx, avx512_bf16, avx2, generic) or `set_isa()` forces
a path. How the weight stream prefetches (hint and distance) is a per-CPU knob: a per-vendor default,
`FIDDLER_KERNEL_STREAM` / `set_stream()` to override it, `tune_stream()` to measure it here (see
`stream()`). Where AMX is used, the token count from which it replaces the vector path is measured
on the machine by `tune_amx()` (the engine runs it on its own experts), and so is the number of weight
blocks a many-token product walks K with (`tune_blocking()`). `read_limit()` is the independent memory-read limit that judges the kernel. Calls
release the GIL.
"""
from __future__ import annotations

import copy
import ctypes
import os
import time
from ctypes import c_void_p

import torch
import torch.nn.functional as F

from . import _lib

__all__ = [
    "PackedExpert", "PackedLinear", "moe_ffn", "isa", "set_isa", "set_amx", "features", "set_num_threads",
    "get_num_threads", "stream", "set_stream", "tune_stream", "tune_amx", "amx_choice", "tune_blocking", "set_super_blocks", "super_blocks_for", "blocking_choice", "read_limit", "limit_buffer", "stream_working_set_bytes",
    "is_available", "load_error", "blocking",
]

_ISA_CODES = {"generic": 0, "avx2": 1, "avx512_bf16": 2}
_ISA_NAMES = {v: k for k, v in _ISA_CODES.items()}
_AMX_OFF, _AMX_HW, _AMX_EMULATED = 0, 1, 2


def is_available() -> bool:
    """Whether the compiled library loaded (it is built by `pip install -e .`)."""
    return _lib.lib is not None


def load_error() -> str | None:
    """Why the library is not available, or None."""
    return _lib.load_error


def _L():
    if _lib.lib is None:
        raise RuntimeError(f"fiddler.kernels unavailable: {_lib.load_error}")
    return _lib.lib


# ------------------------------------------------------------------ ISA selection and threads
def set_isa(name: str | None = None) -> str:
    """Selects the kernel path: None/"auto" (best for this CPU), "amx" (AVX512-BF16 with AMX tiles from
    the default amx_min_tokens up; error without AMX), "avx512_bf16" (no AMX), "avx2", "generic". Returns `isa()`."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        rc = _L().fk_configure(-1, -1, 0)
    elif name == "amx":
        rc = _L().fk_configure(_ISA_CODES["avx512_bf16"], _AMX_HW, 0)
    elif name in _ISA_CODES:
        rc = _L().fk_configure(_ISA_CODES[name], _AMX_OFF, 0)
    else:
        raise ValueError(f"unknown kernel ISA {name!r}; choose one of auto, amx, avx512_bf16, avx2, generic")
    if rc != 0:
        raise ValueError(f"cannot select kernel ISA {name!r}: {_L().fk_last_error().decode()}")
    _AMX_CHOICE.clear()
    _AMX_CHOICE["source"] = "default"
    return isa()


def set_amx(mode: str, min_tokens: int | None = None, source: str = "set_amx") -> None:
    """For tests and experiments: AMX tiles "off", "on" (hardware) or "emulated" (software tiles, any
    CPU), used from `min_tokens` tokens up (None: the default). Keeps the current vector path;
    `set_isa()` restores the defaults."""
    code = {"off": _AMX_OFF, "on": _AMX_HW, "emulated": _AMX_EMULATED}[mode]
    _lib.check(_L().fk_configure(_L().fk_isa(), code, int(min_tokens or 0)))
    _AMX_CHOICE.clear()
    _AMX_CHOICE.update(source=source if min_tokens else "default")


_AMX_CHOICE: dict = {"source": "default"}  # how amx_min_tokens was set (amx_choice())
AMX_TUNE_CANDIDATES = (2, 3, 4, 6, 8, 12, 16)


def amx_choice() -> dict:
    """{"min_tokens", "source"} (+ "ms": {tokens: (amx, vector)} when tune_amx measured it), or
    {"min_tokens": None, "source": why not} where AMX is not in use."""
    if _L().fk_amx_mode() != _AMX_HW:
        return {"min_tokens": None, "source": "AMX not in use"}
    return {"min_tokens": int(_L().fk_amx_min_tokens()), **_AMX_CHOICE}


def amx_crossover(times: dict[int, tuple[float, float]]) -> int:
    """The smallest token count from which AMX is at least as fast as the vector path at every larger
    measured count; times: {tokens: (amx, vector)}. The largest count + 1 if AMX loses at it."""
    chosen = max(times) + 1
    for c in sorted(times, reverse=True):
        if times[c][0] > times[c][1]:
            break
        chosen = c
    return chosen


def _streaming_experts(experts, kind=None) -> list:
    """The experts of class `kind` (default PackedExpert) and the first one's width (and format, if they
    have one), for a tuning that must stream from DRAM: [] unless all such experts given hold more than
    twice the last-level cache."""
    experts = [e for e in experts if isinstance(e, kind or PackedExpert)]
    if not experts or sum(e.nbytes for e in experts) < 2 * _llc_bytes():
        return []
    first = experts[0]
    return [e for e in experts if e.hidden == first.hidden and getattr(e, "fmt", None) == getattr(first, "fmt", None)]


def time_tiles_and_vector(experts, candidates, rounds: int, threads, select, settings) -> dict:
    """{tokens: (tiles ms, vector ms)}: each candidate token count runs under select(settings[0]) (the
    tiles, every call) and select(settings[1]) (the vector path), interleaved, on a different expert each
    time, best of `rounds`. Stored to the microsecond, so that amx_crossover of a record gives its
    min_tokens: a difference below the stored precision is noise, not a win. Used by tune_amx and
    quant.tune_amx; the caller restores its setting."""
    best = {c: [float("inf"), float("inf")] for c in candidates}
    xs = {c: torch.ones(c, experts[0].hidden, dtype=torch.bfloat16) for c in candidates}
    i = 0
    for _ in range(max(1, rounds)):
        for c in candidates:
            for j, setting in enumerate(settings):
                select(setting)
                e = experts[i % len(experts)]
                i += 1
                t = time.perf_counter()
                e.forward(xs[c], threads=threads)
                best[c][j] = min(best[c][j], time.perf_counter() - t)
    return {c: (round(a * 1e3, 3), round(v * 1e3, 3)) for c, (a, v) in best.items()}


def tune_amx(experts, candidates=AMX_TUNE_CANDIDATES, rounds: int = 3, threads: int | None = None) -> dict:
    """Measures from how many tokens AMX tiles beat the vector path, on these packed experts (the engine's
    own: the decode and prefill regime they run in) and sets it. Each candidate token count runs with
    AMX and without, interleaved, on a different expert each time (they must stream from DRAM: callers
    pass more bytes than the last-level cache); the choice is the smallest candidate from which AMX is
    at least as fast at every larger candidate (the largest candidate + 1 if it never is). A no-op
    returning amx_choice() where AMX is not in use. FIDDLER_KERNEL_AMX_MIN_TOKENS overrides it."""
    L = _L()
    if L.fk_amx_mode() != _AMX_HW:
        return amx_choice()
    env = os.environ.get("FIDDLER_KERNEL_AMX_MIN_TOKENS")
    if env:
        set_amx("on", int(env), source="FIDDLER_KERNEL_AMX_MIN_TOKENS")
        return amx_choice()
    experts = _streaming_experts(experts)
    if not experts:
        return amx_choice()  # too few bytes to measure the DRAM regime: keep what is set
    hidden = experts[0].hidden
    prev = int(L.fk_amx_min_tokens())
    try:
        ms = time_tiles_and_vector(experts, candidates, rounds, threads,
                                   lambda mode: _lib.check(L.fk_configure(L.fk_isa(), mode, 1)), (_AMX_HW, _AMX_OFF))
    finally:
        _lib.check(L.fk_configure(L.fk_isa(), _AMX_HW, prev))
    chosen = amx_crossover(ms)
    set_amx("on", chosen, source=f"tune_amx: measured on {len(experts)} experts of {hidden}x{experts[0].ffn}")
    _AMX_CHOICE["ms"] = ms
    return amx_choice()


_BLOCKING_CHOICE: dict = {"source": "default"}  # how the super-blocks were set (blocking_choice())
BLOCKING_TUNE_CANDIDATES = (2, 4, 8)
BLOCKING_TUNE_TOKENS = (64, 256, 512)


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
    _lib.check(_L().fk_set_super_blocks(rows, vals, len(table)))
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


def fastest_blocking(times: dict[int, dict[int, float]]) -> dict[int, int]:
    """For each token count, the candidate with the least time; times: {super_blocks: {tokens: seconds}}.
    A tie keeps the larger candidate (the default's side)."""
    counts = next(iter(times.values()))
    return {t: min(sorted(times, reverse=True), key=lambda c: times[c][t]) for t in counts}


def tune_blocking(experts, candidates=BLOCKING_TUNE_CANDIDATES, tokens=BLOCKING_TUNE_TOKENS, rounds: int = 3,
                  threads: int | None = None) -> dict:
    """Measures how many weight blocks a many-token product should walk K with on this machine, per token
    count, on these packed experts (the engine's own), and sets it: calls up to each measured count use its
    fastest candidate (fastest_blocking). Each candidate runs at each count, interleaved, on a different
    expert each time (they must stream from DRAM: callers pass more bytes than the last-level cache).
    Keeps what is set where the experts are too few bytes to measure. FIDDLER_KERNEL_SUPER_BLOCKS (one
    int for every count) overrides it."""
    env = os.environ.get("FIDDLER_KERNEL_SUPER_BLOCKS")
    if env:
        set_super_blocks(int(env), source="FIDDLER_KERNEL_SUPER_BLOCKS")
        return blocking_choice()
    experts = _streaming_experts(experts)
    if not experts:
        return blocking_choice()  # too few bytes to measure the DRAM regime: keep what is set
    hidden = experts[0].hidden
    prev = dict(_BLOCKING_CHOICE)
    best = {c: {t: float("inf") for t in tokens} for c in candidates}
    xs = {t: torch.ones(t, hidden, dtype=torch.bfloat16) for t in tokens}
    i = 0
    try:
        for _ in range(max(1, rounds)):
            for t in tokens:
                for c in candidates:
                    set_super_blocks(int(c))
                    e = experts[i % len(experts)]
                    i += 1
                    t0 = time.perf_counter()
                    e.forward(xs[t], threads=threads)
                    best[c][t] = min(best[c][t], time.perf_counter() - t0)
    except BaseException:
        set_super_blocks(prev.get("set"), source=prev.get("source", "default"))
        raise
    chosen = fastest_blocking(best)
    set_super_blocks(chosen, source=f"tune_blocking: measured on {len(experts)} experts of {hidden}x{experts[0].ffn}")
    _BLOCKING_CHOICE.update(ms={c: {t: round(s * 1e3, 3) for t, s in ts.items()} for c, ts in best.items()})
    return blocking_choice()


def isa() -> str:
    """The active vector path: "avx512_bf16", "avx2" or "generic" (AMX use: see `features()`)."""
    return _ISA_NAMES[_L().fk_isa()]


def features() -> dict:
    """CPU features seen by the library and which kernel paths are compiled and active."""
    L = _L()
    out = {L.fk_feature_name(i).decode(): bool(L.fk_feature(i)) for i in range(L.fk_num_features())}
    x86 = bool(L.fk_compiled_x86())
    amx = L.fk_amx_mode()
    out.update(
        compiled=["generic", "avx2", "avx512_bf16", "amx"] if x86 else ["generic"],
        best_isa=_ISA_NAMES[L.fk_best_isa()],
        isa=isa(),
        amx_supported=bool(L.fk_amx_supported()),
        amx_active=amx == _AMX_HW,
        amx_emulated=amx == _AMX_EMULATED,
        amx_min_tokens=L.fk_amx_min_tokens(),
        amx_min_tokens_source=_AMX_CHOICE.get("source"),
        amx_status=L.fk_amx_status().decode(),
        stream=stream(),
        blocking=blocking(),
        blocking_source=_BLOCKING_CHOICE.get("source"),
    )
    return out


def blocking(l1d: int = 0, l2: int = 0) -> dict:
    """The blocking of many-token products (more rows than one micro-kernel call takes), derived from the
    cache sizes of this CPU with the super-blocks set here (set_super_blocks, tune_blocking), or of the
    given ones (both > 0) with the default super-blocks: {"k_chunk", "token_chunk", "super_blocks",
    "l1d", "l2"}. Results do not depend on it (the same bits for every blocking)."""
    out = (ctypes.c_int64 * 5)()
    _L().fk_blocking(int(l1d), int(l2), out)
    return dict(zip(("k_chunk", "token_chunk", "super_blocks", "l1d", "l2"), (int(v) for v in out)))


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


# ------------------------------------------------------------------ bandwidth probe
def _llc_bytes() -> int:
    """Largest last-level cache size the OS reports (sysfs and sysconf can disagree in VMs)."""
    sizes = []
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:  # closed: no ResourceWarning
            txt = f.read().strip().upper()
        sizes.append(int(txt.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1], 1))
    except (OSError, ValueError):
        pass
    try:
        sizes.append(int(os.sysconf("SC_LEVEL3_CACHE_SIZE") or 0))
    except (AttributeError, ValueError, OSError):
        pass
    return max(sizes, default=0)


def stream_working_set_bytes() -> int:
    """Bytes a bandwidth measurement must stream so no cache can hold them: 4x the LLC, at least
    1 GiB (on some VMs repeated reads of 512 MiB still come back at twice the DRAM rate), at most
    4 GiB."""
    return min(max(4 * _llc_bytes(), 1 << 30), 4 << 30)


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A 64-byte-aligned uint8 tensor of `nbytes` (huge pages advised), not initialised."""
    raw = torch.empty(nbytes + 64, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 64
    buf = raw[off : off + nbytes]
    _L().fk_advise_hugepages(buf.data_ptr(), nbytes)
    return buf


def _read_gbps(buf: torch.Tensor, threads: int, hint: str, distance: int, repeats: int) -> float:
    gbps = _L().fk_read_bandwidth(buf.data_ptr(), buf.numel(), threads, HINTS.index(hint), distance, repeats)
    if gbps < 0:
        _lib.check(-1)
    return gbps


# ------------------------------------------------------------------ weight-stream tuning
HINTS = ("none", "t0", "t1", "nta")  # codes 0..3 of the C library


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
        _lib.check(_L().fk_set_stream(-1, 0, 0, None))
        return stream()
    if spec == "tune":
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
        raise ValueError(f"cannot set stream prefetch {spec!r}: {_L().fk_last_error().decode()}")
    return stream()


TUNE_CANDIDATES = ("none", "t0:1024", "t0:2048", "t0:1024/4096", "t0:2048/8192", "t1:2048", "nta:1024", "nta:4096")


def tune_stream(candidates=TUNE_CANDIDATES, nbytes: int | None = None, rounds: int = 2,
                hidden: int = 4096, ffn: int = 14336) -> dict:
    """Measures the expert kernel at one token (the decode regime) with each candidate prefetch,
    interleaved over `rounds`, keeps the fastest and returns {"chosen": its spec as stream() gives it,
    "candidate": the winning candidate, "gbps": {candidate: best GB/s}}. The experts (Mixtral-8x7B's shape by default; their weight bits do not matter) are
    cycled through `nbytes` of memory (default: twice the last-level cache, 256 MiB to 2 GiB), so
    they come from DRAM as in decode."""
    nbytes = nbytes or min(max(256 << 20, 2 * _llc_bytes()), 2 << 30)
    L = _L()
    b13, b2 = L.fk_packed_bytes(ffn, hidden, 2), L.fk_packed_bytes(hidden, ffn, 1)
    per = b13 + b2
    count = max(2, nbytes // per)
    w = aligned_buffer(count * per)
    w.view(torch.int16).fill_(0x3C00)  # bf16 2^-7: finite all the way through; the values do not matter
    x = torch.ones(1, hidden, dtype=torch.bfloat16)
    y = torch.empty(1, hidden, dtype=torch.bfloat16)
    prev = stream()
    best = {c: 0.0 for c in candidates}
    i = 0
    try:
        for _ in range(max(1, rounds)):
            for c in candidates:
                set_stream(c, source="tune")
                base = w.data_ptr() + (i % count) * per
                i += 1
                t = time.perf_counter()
                _lib.check(L.fk_expert_ffn(base, base + b13, hidden, ffn, x.data_ptr(), 1, y.data_ptr(), 0))
                best[c] = max(best[c], per / (time.perf_counter() - t) / 1e9)
    finally:
        set_stream(prev["spec"], source=prev["source"])
    winner = max(best, key=best.get)
    st = set_stream(winner, source=f"tune_stream: measured {best[winner]:.1f} GB/s here, best of {len(candidates)}")
    return {"chosen": st["spec"], "candidate": winner, "gbps": best}


# ------------------------------------------------------------------ the independent limit
# Fixed read strategies, never the kernel's own knob: the limit must not share the tuning it judges.
LIMIT_STRATEGIES = (("none", 0), ("t0", 2048), ("t1", 2048), ("nta", 2048))
_LIMIT_CACHE: dict = {}


def limit_buffer(nbytes: int | None = None) -> torch.Tensor:
    """A buffer for read_limit(buffer=...): `nbytes` (default `stream_working_set_bytes()`, rounded to
    whole 16 KiB rows), 64-byte aligned and written, so every page is backed (zero pages would all
    map one physical page). Allocate it once to measure the limit repeatedly without re-faulting."""
    nbytes = nbytes or stream_working_set_bytes()
    if nbytes < (1 << 20):
        raise ValueError("read_limit needs nbytes >= 1 MiB")
    nbytes = nbytes // (16 << 10) * (16 << 10)
    buf = aligned_buffer(nbytes) if is_available() else torch.empty(nbytes, dtype=torch.uint8)
    buf.view(torch.float32).fill_(1.0)
    return buf


def read_limit(nbytes: int | None = None, threads: int | None = None, repeats: int = 3, cached: bool = True,
               buffer: torch.Tensor | None = None) -> dict:
    """The memory-read limit of this host, the one probe of the project (the engine's decode bound,
    `environment=local` and the benchmarks all use it): the best of several streaming reads (plain
    loads and T0/T1/NTA prefetch at `threads` threads, plain loads at one) and of an fp32 GEMV (torch
    F.linear, one token) over the same `nbytes` buffer (default `stream_working_set_bytes()`), each
    the best of `repeats`. None of them uses the kernel's stream tuning. Without the compiled library
    only the GEMV runs. `buffer` (from limit_buffer) replaces `nbytes` for repeated measurements.
    Returns {"gbps": best, "best": its name, "strategies": {name: GB/s}, "nbytes", "threads"};
    measured once per process and argument set unless cached=False (always with a buffer)."""
    n = _threads(threads) or (get_num_threads() if is_available() else torch.get_num_threads())
    if repeats < 1:
        raise ValueError("read_limit needs repeats >= 1")
    key = (nbytes or stream_working_set_bytes(), n, repeats)
    cached = cached and buffer is None
    if cached and key in _LIMIT_CACHE:
        return copy.deepcopy(_LIMIT_CACHE[key])
    buf = buffer if buffer is not None else limit_buffer(nbytes)
    k = 4096
    nbytes = buf.numel()
    w = buf.view(torch.float32).view(-1, k)
    res: dict[str, float] = {}
    if is_available():
        for hint, dist in LIMIT_STRATEGIES:
            res[f"read_{hint}_{n}t"] = _read_gbps(buf, n, hint, dist, repeats)
        if n > 1:
            res["read_none_1t"] = _read_gbps(buf, 1, "none", 0, repeats)
    res[f"gemv_fp32_{n}t"] = _gemv_gbps(w, n, repeats, warmup=True)
    best = max(res, key=res.get)
    out = {"gbps": res[best], "best": best, "strategies": res, "nbytes": nbytes, "threads": n}
    if cached:
        _LIMIT_CACHE[key] = copy.deepcopy(out)
    return out


def _gemv_gbps(w: torch.Tensor, threads: int, repeats: int, warmup: bool) -> float:
    """GB/s of torch's fp32 GEMV (one token) over w [rows, 4096], best of `repeats`, at `threads` threads."""
    x = torch.ones(1, w.shape[1])
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if warmup:
            F.linear(x, w)
        t_best = min(_timed(lambda: F.linear(x, w)) for _ in range(repeats))
    finally:
        torch.set_num_threads(prev)
    return w.numel() * 4 / t_best / 1e9


READ_ONCE_STRATEGIES = tuple(h for h, _ in LIMIT_STRATEGIES) + ("gemv",)


def read_once_gbps(buf: torch.Tensor, strategy: str, threads: int | None = None) -> float:
    """GB/s of one cold read of `buf` (a 1-D uint8 tensor: a limit_buffer, or a packed expert's weights)
    by one of read_limit's strategies at `threads` threads: "none", "t0", "t1", "nta" (the library's
    streaming reads at read_limit's distances) or "gemv" (torch's fp32 GEMV over the buffer's whole
    16 KiB rows). No warm-up and no repeat: a benchmark that compares a kernel with the memory it streams
    reads other copies of the same weights with it, one strategy a round, so that no read warms a
    buffer for the next (benchmarks/test_kernel_ratios.py)."""
    if strategy not in READ_ONCE_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(READ_ONCE_STRATEGIES)}, got {strategy!r}")
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError("read_once_gbps needs a 1-D torch.uint8 tensor")
    n = _threads(threads) or (get_num_threads() if is_available() else torch.get_num_threads())
    if strategy == "gemv":
        rows = buf.numel() // (16 << 10)
        if rows < 1:
            raise ValueError("read_once_gbps('gemv') needs at least one 16 KiB row")
        return _gemv_gbps(buf[: rows * (16 << 10)].view(torch.float32).view(rows, 4096), n, 1, warmup=False)
    if not is_available():
        raise RuntimeError(f"kernel library not available: {load_error()}")
    return _read_gbps(buf, n, strategy, dict(LIMIT_STRATEGIES)[strategy], 1)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ------------------------------------------------------------------ packed weights
def _check_tensor(name: str, t, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be torch.bfloat16, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")


def _pack(ws: list[torch.Tensor], n: int, k: int) -> torch.Tensor:
    """Packs equally shaped [n, k] matrices into one 64-byte-aligned uint8 buffer."""
    if n < 1 or k < 1:
        raise ValueError(f"weights must not be empty, got shape ({n}, {k})")
    L = _L()
    buf = aligned_buffer(L.fk_packed_bytes(n, k, len(ws)))
    ptrs = (c_void_p * len(ws))(*[w.data_ptr() for w in ws])
    _lib.check(L.fk_pack(ptrs, len(ws), n, k, buf.data_ptr(), 0))
    return buf


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    buf = aligned_buffer(t.numel())
    buf.copy_(t.reshape(-1))
    return buf


def _check_x(x, k: int, what: str) -> int:
    _check_tensor("x", x, 2)
    if x.shape[1] != k:
        raise ValueError(f"x must be [tokens, {k}] for this {what}, got {tuple(x.shape)}")
    return x.shape[0]


def _check_out(out, shape: tuple, dtype: torch.dtype) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype or out.device.type != "cpu" or tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous CPU {dtype} tensor of shape {shape}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )


class PackedExpert:
    """One MoE expert (SwiGLU FFN) packed for the CPU kernel. w1 (gate), w3 (up): [ffn, hidden];
    w2 (down): [hidden, ffn]; bf16 as stored by Hugging Face."""

    def __init__(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor):
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            _check_tensor(name, w, 2)
        ffn, hidden = w1.shape
        if tuple(w3.shape) != (ffn, hidden) or tuple(w2.shape) != (hidden, ffn):
            raise ValueError(
                f"expert shapes disagree: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)} must be [ffn, hidden] "
                f"and w2 {tuple(w2.shape)} must be [hidden, ffn]"
            )
        self.hidden, self.ffn = int(hidden), int(ffn)
        self._w13 = _pack([w1, w3], ffn, hidden)
        self._w2 = _pack([w2], hidden, ffn)
        self.nbytes = self._w13.numel() + self._w2.numel()

    @classmethod
    def from_packed(cls, hidden: int, ffn: int, w13: torch.Tensor, w2: torch.Tensor) -> "PackedExpert":
        """From packed buffers (`packed()` of an expert of this shape), used as they are when 64-byte aligned
        (e.g. pinned host memory the GPU side copies from), else copied."""
        self = cls.__new__(cls)
        self.hidden, self.ffn = int(hidden), int(ffn)
        L = _L()
        for name, t, n, k, g in (("w13", w13, ffn, hidden, 2), ("w2", w2, hidden, ffn, 1)):
            want = L.fk_packed_bytes(n, k, g)
            if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != want or t.device.type != "cpu":
                raise ValueError(f"packed {name} must be {want} uint8 CPU bytes, got {tuple(t.shape)} {t.dtype}")
        self._w13, self._w2 = (t if t.data_ptr() % 64 == 0 and t.is_contiguous() else _aligned_copy(t)
                               for t in (w13, w2))
        self.nbytes = self._w13.numel() + self._w2.numel()
        return self

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed (w13, w2) buffers (fiddler.kernels.layout describes and unpacks them)."""
        return self._w13, self._w2

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        tokens = _check_x(x, self.hidden, "expert")
        nthreads = _threads(threads)
        if out is None:
            out = torch.empty(tokens, self.hidden, dtype=torch.bfloat16)
        else:
            _check_out(out, (tokens, self.hidden), torch.bfloat16)
        if tokens:
            _lib.check(
                _L().fk_expert_ffn(
                    self._w13.data_ptr(), self._w2.data_ptr(), self.hidden, self.ffn,
                    x.data_ptr(), tokens, out.data_ptr(), nthreads,
                )
            )
        return out

    __call__ = forward


class PackedLinear:
    """y = x @ w.T (+ bias) for w [out_features, in_features] bf16 (nn.Linear layout)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None):
        _check_tensor("w", w, 2)
        self.out_features, self.in_features = (int(s) for s in w.shape)
        self.bias = None
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
                raise TypeError("bias must be a floating-point torch.Tensor")
            if tuple(bias.shape) != (self.out_features,) or bias.device.type != "cpu":
                raise ValueError(f"bias must be a CPU tensor of shape ({self.out_features},), got {tuple(bias.shape)}")
            self.bias = bias.to(torch.float32).contiguous()
        self._w = _pack([w], self.out_features, self.in_features)
        self.nbytes = self._w.numel()

    def forward(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None = None,
        threads: int | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
        tokens = _check_x(x, self.in_features, "linear")
        nthreads = _threads(threads)
        if out is None:
            out = torch.empty(tokens, self.out_features, dtype=out_dtype)
        else:
            _check_out(out, (tokens, self.out_features), out_dtype)
        if tokens:
            _lib.check(
                _L().fk_linear(
                    self._w.data_ptr(), self.out_features, self.in_features, x.data_ptr(), tokens,
                    self.bias.data_ptr() if self.bias is not None else None, out.data_ptr(),
                    int(out_dtype == torch.float32), nthreads,
                )
            )
        return out

    __call__ = forward


def moe_ffn(experts: list[PackedExpert], weights: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None,
            threads: int | None = None) -> torch.Tensor:
    """The MoE combine of one decode step in one call: sum_e bf16(bf16(experts[e](x)) * weights[e]) for rows
    x [tokens, hidden] that all use the same experts (fp32 sum rounded to bf16 once, like
    `(y * w).sum(dim)` in torch). weights: bf16 [len(experts)]. One pooled region for every expert's
    gate/up pass and one for the down passes (two barriers per layer instead of two per expert)."""
    if not experts:
        raise ValueError("moe_ffn needs at least one expert")
    hidden, ffn = experts[0].hidden, experts[0].ffn
    if any(e.hidden != hidden or e.ffn != ffn for e in experts):
        raise ValueError("moe_ffn: experts must share one shape")
    tokens = _check_x(x, hidden, "expert")
    _check_tensor("weights", weights, 1)
    if weights.shape[0] != len(experts):
        raise ValueError(f"weights must have one entry per expert ({len(experts)}), got {weights.shape[0]}")
    if out is None:
        out = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    else:
        _check_out(out, (tokens, hidden), torch.bfloat16)
    if tokens:
        n = len(experts)
        p13 = (ctypes.c_void_p * n)(*(e._w13.data_ptr() for e in experts))
        p2 = (ctypes.c_void_p * n)(*(e._w2.data_ptr() for e in experts))
        _lib.check(_L().fk_moe_ffn(p13, p2, weights.data_ptr(), n, hidden, ffn, x.data_ptr(), tokens,
                                   out.data_ptr(), _threads(threads)))
    return out


if _lib.lib is not None and os.environ.get("FIDDLER_KERNEL_ISA"):
    set_isa(os.environ["FIDDLER_KERNEL_ISA"])
if _lib.lib is not None and os.environ.get("FIDDLER_KERNEL_STREAM"):
    set_stream(os.environ["FIDDLER_KERNEL_STREAM"], source="FIDDLER_KERNEL_STREAM")

from . import quant  # noqa: E402,F401 -- quantized weights (Q8_0 / Q4_0); needs the names above
