"""CPU kernels for Fiddler's CPU expert path: a fused expert FFN y = W2 (silu(W1 x) * (W3 x)) and a
plain linear layer on bf16 weights with fp32 accumulation (C++, see csrc/), the same on llama.cpp's
Q8_0 / Q4_0 blocks (`quant`), and the fused ops of a decode step (`decode`, `attention`).

Weights are packed once (`PackedExpert`, `PackedLinear`) into a layout that streams contiguously;
every call reads each weight byte once whatever the token count. The instruction set is chosen at run
time from the CPU: AVX512-BF16 (plus AMX tiles for many tokens where the CPU has AMX), else AVX-512 F (bf16
widened to fp32), else AVX2/FMA, else portable C++. `FIDDLER_KERNEL_ISA` (auto, amx, avx512_bf16, avx512, avx2,
generic) or `set_isa()` forces
a path. How the weight stream prefetches (hint and distance) is a per-CPU knob: a per-vendor default,
`FIDDLER_KERNEL_STREAM` / `set_stream()` to override it, `tune_stream()` to measure it here (see
`stream()`). Where AMX is used, the token count from which it replaces the vector path is measured
on the machine by `tune_amx()` (the engine runs it on its own experts), and so is the number of weight
blocks a many-token product walks K with (`tune_blocking()`). `read_limit()` is the independent
memory-read limit that judges the kernel. Calls release the GIL.

The modules: `_lib` binds the library from its header (csrc/fk_api.h), `constants` holds the values the
C++ side shares (pure Python), `settings` the run-time knobs, `packed` the bf16 weights, `route` the
router's top-k of a decode row, `argmax` the greedy token choice, `probe` the bandwidth probe, `tuning` the
per-machine tuners, `timing` how they time, `layout` and `roofline` the packed layouts in torch and the
compute peak. Nothing here imports the rest of fiddler.
"""
from __future__ import annotations

import os

# the package's names: what the engine, the benchmarks and the tests call (re-exports)
from . import _lib, constants, timing  # noqa: F401
from ._lib import L as _L  # noqa: F401
from .packed import ExpertTable, PackedExpert, PackedLinear, aligned_buffer, moe_ffn, moe_ffn_residual  # noqa: F401
from .probe import (LIMIT_STRATEGIES, READ_ONCE_STRATEGIES, limit_buffer, llc_bytes, read_limit,  # noqa: F401
                    read_once_gbps, stream_working_set_bytes)
from .settings import (HINTS, amx_choice, blocking, blocking_choice, features, get_num_threads,  # noqa: F401
                       is_available, isa, load_error, set_amx, set_isa, set_num_threads, set_stream, set_super_blocks,
                       stream, super_blocks_for)
from .tuning import (AMX_TUNE_CANDIDATES, BLOCKING_TUNE_CANDIDATES, BLOCKING_TUNE_TOKENS,  # noqa: F401
                     TUNE_CANDIDATES, amx_crossover, fastest_blocking, time_tiles_and_vector, tune_amx, tune_blocking,
                     tune_stream)

__all__ = [
    "ExpertTable", "PackedExpert", "PackedLinear", "moe_ffn", "moe_ffn_residual", "isa", "set_isa", "set_amx", "features", "set_num_threads",
    "get_num_threads", "stream", "set_stream", "tune_stream", "tune_amx", "amx_choice", "tune_blocking",
    "set_super_blocks", "super_blocks_for", "blocking_choice", "read_limit", "limit_buffer",
    "stream_working_set_bytes", "is_available", "load_error", "blocking", "constants", "timing",
]

if _lib.lib is not None and os.environ.get("FIDDLER_KERNEL_ISA"):
    set_isa(os.environ["FIDDLER_KERNEL_ISA"])
if _lib.lib is not None and os.environ.get("FIDDLER_KERNEL_STREAM"):
    set_stream(os.environ["FIDDLER_KERNEL_STREAM"], source="FIDDLER_KERNEL_STREAM")

from . import quant  # noqa: E402,F401 -- quantized weights (Q8_0 / Q4_0), after the settings from the environment
