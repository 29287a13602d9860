"""fiddler.kernels thread pool: results independent of thread counts and of concurrent callers, a
late or busy pool never blocks a caller, and forked children get a working pool."""
from __future__ import annotations

import ctypes
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

import fiddler.kernels as fk

pytestmark = pytest.mark.skipif(not fk.is_available(), reason=f"kernel library not built: {fk.load_error()}")


def _layers():
    g = torch.Generator().manual_seed(7)
    lins = [fk.PackedLinear((torch.randn(o, 256, generator=g) / 16).bfloat16()) for o in (64, 200, 1000, 3000)]
    xs = [torch.randn(t, 256, generator=g).bfloat16() for t in (1, 3, 9)]
    ref = {(i, j): lins[i].forward(xs[j], threads=1) for i in range(len(lins)) for j in range(len(xs))}
    return lins, xs, ref


def test_concurrent_mixed_calls_match_single_threaded_results():
    lins, xs, ref = _layers()
    bad, errors = [], []

    def work(seed):
        r = random.Random(seed)
        try:
            for _ in range(400):
                i, j = r.randrange(len(lins)), r.randrange(len(xs))
                y = lins[i].forward(xs[j], threads=r.choice([None, 1, 2, 3]))
                if not torch.equal(y, ref[(i, j)]):
                    bad.append((i, j))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors and not bad and not any(t.is_alive() for t in ts)


def test_call_while_pool_is_busy_does_not_wait_for_it():
    # a region of our own holds the pool until we release it: a call from another thread that waited
    # for the pool would never finish while it is held, on any machine, so no timing is compared
    held, release = threading.Event(), threading.Event()

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
    def hold(ctx, begin, end):
        held.set()
        release.wait(300)

    g = torch.Generator().manual_seed(1)
    lin = fk.PackedLinear((torch.randn(1024, 1024, generator=g) / 32).bfloat16())  # big enough for 2 threads
    x = torch.randn(1, 1024, generator=g).bfloat16()
    expected = lin.forward(x, threads=1)
    holder = threading.Thread(target=fk._lib.lib.fk_parallel_for, args=(2, 2, ctypes.cast(hold, ctypes.c_void_p), None))
    holder.start()
    try:
        assert held.wait(120), "the holding region never started"
        got = {}
        caller = threading.Thread(target=lambda: got.setdefault("y", lin.forward(x, threads=2)))
        caller.start()
        caller.join(120)  # a bound for a deadlock, not a timing: the pool stays held throughout
        assert not caller.is_alive(), "a call waited for the busy pool"
        assert not release.is_set() and holder.is_alive()  # it finished while the pool was held
    finally:
        release.set()
        holder.join(120)
    assert torch.equal(got["y"], expected)


def test_pool_works_in_forked_child():
    # the parent's workers do not exist after fork(); the child must still compute (and not hang)
    code = """
import os, torch, fiddler.kernels as fk
w = (torch.randn(512, 256) / 16).bfloat16(); x = torch.randn(5, 256).bfloat16()
lin = fk.PackedLinear(w); ref = lin.forward(x, threads=2)
pid = os.fork()
if pid == 0:
    ok = torch.equal(lin.forward(x, threads=2), ref) and torch.equal(lin.forward(x, threads=2), ref)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "child 0" in r.stdout
