"""The kernel's per-machine tuners, each measured on the machine (and on the engine's own experts where it
runs them) with interleaved rounds, and each overridable by an environment variable: the AMX crossover
of every format (`tune_amx`), the many-token blocking (`tune_blocking`) and the weight stream's prefetch
(`tune_stream`). The rules that turn times into a choice (`amx_crossover`, `fastest_blocking`) are plain
functions, tested on injected times; the times come from fiddler.kernels.timing."""
from __future__ import annotations

import os

import torch

from . import _lib, probe, settings, timing
from .constants import AMX_MODES, AMX_NEVER
from .packed import PackedExpert, aligned_buffer
from .settings import blocking_choice, set_stream, set_super_blocks, stream


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
    if not experts or sum(e.nbytes for e in experts) < 2 * probe.llc_bytes():
        return []
    first = experts[0]
    return [e for e in experts if e.hidden == first.hidden and getattr(e, "fmt", None) == getattr(first, "fmt", None)]


def time_tiles_and_vector(experts, candidates, rounds: int, threads, select, settings) -> dict:
    """{tokens: (tiles ms, vector ms)}: each candidate token count runs under select(settings[0]) (the
    tiles, every call) and select(settings[1]) (the vector path), interleaved, on a different expert each
    time, best of `rounds`. Stored to the microsecond, so that amx_crossover of a record gives its
    min_tokens: a difference below the stored precision is noise, not a win. Used by tune_amx; the
    caller restores its setting."""
    best = {c: [float("inf"), float("inf")] for c in candidates}
    xs = {c: torch.ones(c, experts[0].hidden, dtype=torch.bfloat16) for c in candidates}
    i = 0
    for _ in range(max(1, rounds)):
        for c in candidates:
            for j, setting in enumerate(settings):
                select(setting)
                e = experts[i % len(experts)]
                i += 1
                best[c][j] = min(best[c][j], timing.elapsed(lambda: e.forward(xs[c], threads=threads)))
    return {c: (round(a * 1e3, 3), round(v * 1e3, 3)) for c, (a, v) in best.items()}



AMX_TUNE_CANDIDATES = (2, 3, 4, 6, 8, 12, 16)  # bf16 (AMX-BF16); quantized formats: quant.AMX_TUNE_CANDIDATES


def tune_amx(experts, candidates=None, rounds: int = 3, threads: int | None = None) -> dict:
    """Measures from how many tokens AMX tiles beat the vector path on these packed experts (the engine's
    own: the decode and prefill regime they run in) and sets it, for their format: bf16 PackedExperts set
    the AMX-BF16 crossover (returns amx_choice()), QuantExperts of one format that format's AMX-INT8
    crossover (returns quant.amx()). Each candidate token count (default: the format's *_TUNE_CANDIDATES)
    runs with the tiles and without, interleaved, on a different expert each time (they must stream from
    DRAM: callers pass more bytes than twice the last-level cache); the choice is the smallest candidate
    from which the tiles are at least as fast at every larger candidate (amx_crossover; the largest + 1,
    for a quantized format AMX_NEVER, if they never are). A no-op returning the current choice where the
    tiles are not in use or the experts are too few bytes. FIDDLER_KERNEL_AMX_MIN_TOKENS overrides the
    bf16 measurement."""
    from . import quant

    quantized = any(isinstance(e, quant.QuantExpert) for e in experts)
    if quantized:
        current, set_amx, state = quant.amx, quant.set_amx, quant._AMX_CHOICE
        tiles, prev = quant.amx()["amx"], quant.amx()["min_tokens"]  # tiles: "on", or "emulated" in tests
        candidates = candidates or quant.AMX_TUNE_CANDIDATES
    else:
        current, set_amx, state = settings.amx_choice, settings.set_amx, settings._AMX_CHOICE
        on = _lib.L().fk_amx_mode() == AMX_MODES["on"]
        tiles, prev = ("on" if on else "off"), int(_lib.L().fk_amx_min_tokens())
        candidates = candidates or AMX_TUNE_CANDIDATES
        env = os.environ.get("FIDDLER_KERNEL_AMX_MIN_TOKENS")
        if on and env:
            set_amx("on", int(env), source="FIDDLER_KERNEL_AMX_MIN_TOKENS")
            return current()
    experts = _streaming_experts(experts, quant.QuantExpert if quantized else PackedExpert)
    if tiles == "off" or not experts:
        return current()  # no tiles, or too few bytes to measure the DRAM regime: keep what is set
    fmt, hidden, ffn = getattr(experts[0], "fmt", None), experts[0].hidden, experts[0].ffn
    prev_state = dict(state)
    try:
        ms = time_tiles_and_vector(experts, candidates, rounds, threads, lambda s: set_amx(s, 1), (tiles, "off"))
    finally:
        set_amx(tiles, prev)
        state.clear()
        state.update(prev_state)
    chosen = amx_crossover(ms)
    what = f"{len(experts)} {fmt + ' ' if fmt else ''}experts of {hidden}x{ffn}"
    if quantized:
        set_amx(tiles, {**prev, fmt: min(chosen, AMX_NEVER)}, source=f"tune_amx: measured on {what}")
        state["ms"] = {**prev_state.get("ms", {}), fmt: ms}
    else:
        set_amx("on", chosen, source=f"tune_amx: measured on {what}")
        state["ms"] = ms
    return current()


BLOCKING_TUNE_CANDIDATES = (2, 4, 8)
BLOCKING_TUNE_TOKENS = (64, 256, 512)


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
    prev = dict(settings._BLOCKING_CHOICE)
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
                    best[c][t] = min(best[c][t], timing.elapsed(lambda: e.forward(xs[t], threads=threads)))
    except BaseException:
        set_super_blocks(prev.get("set"), source=prev.get("source", "default"))
        raise
    chosen = fastest_blocking(best)
    set_super_blocks(chosen, source=f"tune_blocking: measured on {len(experts)} experts of {hidden}x{experts[0].ffn}")
    settings._BLOCKING_CHOICE.update(ms={c: {t: round(s * 1e3, 3) for t, s in ts.items()} for c, ts in best.items()})
    return blocking_choice()


TUNE_CANDIDATES = ("none", "t0:1024", "t0:2048", "t0:1024/4096", "t0:2048/8192", "t1:2048", "nta:1024", "nta:4096")


def tune_stream(candidates=TUNE_CANDIDATES, nbytes: int | None = None, rounds: int = 2,
                hidden: int = 4096, ffn: int = 14336) -> dict:
    """Measures the expert kernel at one token (the decode regime) with each candidate prefetch,
    interleaved over `rounds`, keeps the fastest and returns {"chosen": its spec as stream() gives it,
    "candidate": the winning candidate, "gbps": {candidate: best GB/s}}. The experts (Mixtral-8x7B's shape
    by default; their weight bits do not matter) are cycled through `nbytes` of memory (default: twice
    the last-level cache, 256 MiB to 2 GiB), so they come from DRAM as in decode."""
    nbytes = nbytes or min(max(256 << 20, 2 * probe.llc_bytes()), 2 << 30)
    L = _lib.L()
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
                s = timing.elapsed(lambda: _lib.check(L.fk_expert_ffn(base, base + b13, hidden, ffn, x.data_ptr(), 1,
                                                                      y.data_ptr(), 0)))
                best[c] = max(best[c], per / s / 1e9)
    finally:
        set_stream(prev["spec"], source=prev["source"])
    winner = max(best, key=best.get)
    st = set_stream(winner, source=f"tune_stream: measured {best[winner]:.1f} GB/s here, best of {len(candidates)}")
    return {"chosen": st["spec"], "candidate": winner, "gbps": best}

