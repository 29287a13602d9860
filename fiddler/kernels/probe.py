"""The memory-read limit of this host, the one bandwidth probe of the project (the engine's decode bound,
`environment=local` and the benchmarks judge the kernel by it): streaming reads by the library at fixed
prefetch strategies, never the kernel's own tuning, and torch's fp32 GEMV over the same buffer."""
from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F

from . import _lib
from .constants import STREAM_HINTS as HINTS
from .packed import aligned_buffer
from .settings import _threads, get_num_threads, is_available, load_error
from .timing import best_time

_L = _lib.L


def llc_bytes() -> int:
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
    return min(max(4 * llc_bytes(), 1 << 30), 4 << 30)

def _read_gbps(buf: torch.Tensor, threads: int, hint: str, distance: int, repeats: int) -> float:
    gbps = _L().fk_read_bandwidth(buf.data_ptr(), buf.numel(), threads, HINTS.index(hint), distance, repeats)
    if gbps < 0:
        _lib.check(-1)
    return gbps

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
        t_best = best_time(lambda: F.linear(x, w), repeats, warmup=0)
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
