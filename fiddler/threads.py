"""torch's intra-op thread count, set for a stretch of code (the engine and the model switch it), and the
kernel thread count of a decode step's small calls."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Temporarily set torch's intra-op thread count (None: leave it)."""
    prev = torch.get_num_threads()
    if n is not None and n != prev:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None and n != prev:
            torch.set_num_threads(prev)


# A decode step's kernel call over fewer weight bytes than this (a small model's experts of one row, its
# lm_head) runs on the calling thread: waking the kernel's pool, and its workers spinning between calls,
# cost more than the split saves. tiny_mixtral's two experts (480 KiB): 14.7 us on one thread against 27.8
# us on two; its lm_head (256 KiB) 12.7 us a token while the pool was kept awake, 111 us once only it woke
# the pool (2-vCPU AMD EPYC family 25 model 17, shared;
# results/measured/2026-12-06-amd-epyc-issue54-decode-overhead). Results do not depend on the thread count.
SMALL_CALL_BYTES = 1 << 20


def small_call_threads(nbytes: int, threads: int | None) -> int | None:
    """`threads` for a decode-step call over `nbytes` of weights, or 1 below SMALL_CALL_BYTES."""
    return 1 if nbytes < SMALL_CALL_BYTES else threads
