"""The GPU budget's one rule: a budget as a user gives it (GiB, 0, or `auto`) to bytes, and why. Torch-free, so
the harness's start checks apply the same rule as the engine (fiddler.gpu_side.GpuSide.for_budget_gb).

`auto` (also the default when no budget is given) is DEFAULT_CUDA_FRACTION (90%) of a free-memory reading:
- by default this host's: the CUDA device's free memory now (measured_free_memory);
- injected by a caller that describes a card: mode=simulate reads the environment's card as empty, its whole
  memory free (rtx4090: 90% of 24 GiB);
- without CUDA there is nothing to read, so `auto` means no GPU; an emulated GPU (the CPU device standing in)
  is sized only by a number of GiB.
Tests inject a reading into a subprocess with $FIDDLER_FAKE_FREE_GPU_BYTES.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Union

AUTO = "auto"

#: share of the free GPU memory a budget of `auto` (or none given) takes; the rest is headroom for what else
#: the device holds (other processes, the allocator's fragmentation)
DEFAULT_CUDA_FRACTION = 0.9

#: for tests only: a free-memory reading in bytes that stands in for the CUDA device's, also in a subprocess
#: (`python -m fiddler.server`, `run.py`); without CUDA, `auto` then sizes an emulated GPU from it
FAKE_FREE_ENV = "FIDDLER_FAKE_FREE_GPU_BYTES"


@dataclass(frozen=True)
class FreeMemory:
    """A free-memory reading `auto` sizes a budget from: bytes, and what was read (said in the record)."""
    bytes: int
    what: str


def measured_free_memory(device="cuda") -> FreeMemory | None:
    """This host's reading: $FIDDLER_FAKE_FREE_GPU_BYTES where set (tests), else the CUDA device's free memory
    now, else None (no CUDA)."""
    fake = os.environ.get(FAKE_FREE_ENV)
    if fake:
        return FreeMemory(int(fake), f"free GPU memory (${FAKE_FREE_ENV}, a test's reading)")
    import torch  # only where a reading is taken

    if not torch.cuda.is_available():
        return None
    return FreeMemory(int(torch.cuda.mem_get_info(torch.device(device))[0]), "free CUDA memory")


def auto_budget_bytes(free_bytes: int) -> int:
    """The one place of the rule `auto` follows: DEFAULT_CUDA_FRACTION of the free memory."""
    return int(free_bytes * DEFAULT_CUDA_FRACTION)


Requested = Union[float, int, str, None]


def check_requested(gb: Requested) -> None:
    """Raise ValueError unless `gb` is a budget a user may give: a finite number of GiB >= 0, "auto" or None."""
    if gb is None or gb == AUTO:
        return
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not math.isfinite(gb) or gb < 0:
        raise ValueError(f"a GPU budget is a finite number of GiB >= 0 or {AUTO!r}, not {gb!r}")


def parse_requested(text: str) -> float | str:
    """A budget from a command line: "auto" or a number of GiB (ValueError otherwise)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        gb = float(text)
    except ValueError:
        raise ValueError(f"a GPU budget is a finite number of GiB >= 0 or {AUTO!r}, not {text!r}") from None
    check_requested(gb)
    return gb


@dataclass(frozen=True)
class Budget:
    """A budget as asked (`requested`: GiB, "auto", or None for the default), what it became (`bytes`; None =
    no GPU) and why (`source`), for records and logs."""
    requested: Requested
    bytes: int | None
    source: str

    def to_dict(self) -> dict:
        return {"requested": self.requested, "bytes": self.bytes, "source": self.source}


def choose_budget(gb: Requested, free: FreeMemory | None | Callable[[], FreeMemory | None] = measured_free_memory
                  ) -> Budget:
    """The library's one rule from a budget as a user gives it to bytes: a number of GiB (0: no GPU), or "auto"
    (None, the default, is the same): DEFAULT_CUDA_FRACTION of `free`, a free-memory reading or a function
    that reads one (by default this host's, measured_free_memory; mode=simulate passes the described card's
    memory). With no reading (no CUDA), auto is no GPU."""
    if gb is None or gb == AUTO:
        reading = free() if callable(free) else free
        said = AUTO if gb == AUTO else "default (auto)"
        if reading is None:
            return Budget(gb, None, f"{said}: no GPU memory to size from (no CUDA device, or a card "
                                    f"of 0 GB), so no GPU (a budget in GiB emulates one)")
        share = f"{DEFAULT_CUDA_FRACTION:.0%}"
        return Budget(gb, auto_budget_bytes(reading.bytes),
                      f"{said}: {share} of {reading.bytes / 2**30:.1f} GiB {reading.what}")
    check_requested(gb)
    if gb == 0:
        return Budget(gb, None, "0: no GPU")
    return Budget(gb, int(gb * (1 << 30)), f"{gb:g} GiB as given")
