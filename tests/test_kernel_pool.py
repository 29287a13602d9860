"""fiddler.kernels thread pool: results independent of thread counts and of concurrent callers, a
late or busy pool never blocks a caller, and forked children get a working pool."""
from __future__ import annotations

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
    # a long call holds the pool; a short call from another thread must finish long before it
    g = torch.Generator().manual_seed(1)
    big = fk.PackedLinear((torch.randn(4096, 4096, generator=g) / 64).bfloat16())
    small = fk.PackedLinear((torch.randn(64, 128, generator=g) / 16).bfloat16())
    xb = torch.randn(48, 4096, generator=g).bfloat16()
    xs = torch.randn(1, 128, generator=g).bfloat16()
    expected = small.forward(xs, threads=1)
    t0 = time.perf_counter()
    big.forward(xb)
    big_s = time.perf_counter() - t0
    started, done = threading.Event(), {}

    def long_call():
        started.set()
        for _ in range(3):
            big.forward(xb)
        done["long"] = time.perf_counter()

    th = threading.Thread(target=long_call)
    th.start()
    started.wait()
    time.sleep(big_s / 4)
    ys = small.forward(xs)
    done["short"] = time.perf_counter()
    th.join()
    assert torch.equal(ys, expected)
    assert done["short"] < done["long"]


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
