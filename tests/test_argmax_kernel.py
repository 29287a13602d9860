"""Greedy token choice in C (fiddler.kernels.argmax, csrc/fk_argmax.cpp): torch.argmax's index on finite rows
(ties included: the first of equal maxima), -1 on a row holding a NaN or an inf, and fiddler.generate's
greedy_rows the same with the kernel and without it."""
from __future__ import annotations

import pytest
import torch

import fiddler.generate as fg
from fiddler.kernel_loader import load_argmax_kernels

ka = load_argmax_kernels()
needs_kernel = pytest.mark.skipif(ka is None, reason="kernel library not built")


def cases(seed: int = 0):
    """Logits with many ties (values on a coarse grid, maxima repeated), signed zeros, huge values whose sum
    overflows, one-column rows, and rows with a NaN, +inf or -inf somewhere (first, last, middle)."""
    g = torch.Generator().manual_seed(seed)
    for n in (1, 2, 7, 1024, 32000):
        for rows in (1, 3, 16):
            yield torch.randn(rows, n, generator=g)
            yield torch.randint(-3, 4, (rows, n), generator=g).float()  # ties everywhere
            yield torch.full((rows, n), 3e38) * torch.randint(0, 2, (rows, n), generator=g)
            zeros = torch.zeros(rows, n)
            zeros[:, ::2] = -0.0
            yield zeros
            for bad in (float("nan"), float("inf"), -float("inf")):
                for at in {0, n // 2, n - 1}:
                    x = torch.randn(rows, n, generator=g)
                    x[rows // 2, at] = bad
                    yield x


def reference(x: torch.Tensor) -> list[int]:
    ok = torch.isfinite(x).all(dim=-1).tolist()
    return [t if fine else -1 for t, fine in zip(torch.argmax(x, dim=-1).tolist(), ok)]


@needs_kernel
def test_the_kernel_gives_torch_argmax_or_minus_one():
    n_cases = 0
    for x in cases():
        assert ka.argmax_finite(x) == reference(x), (x.shape, x)
        n_cases += 1
    assert n_cases > 100


@needs_kernel
def test_the_kernel_refuses_what_it_does_not_read():
    for bad in (torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(4, 3).t(), torch.zeros(4), torch.zeros(2, 0)):
        with pytest.raises(ValueError, match="contiguous non-empty 2-D CPU float32"):
            ka.argmax_finite(bad)


def test_greedy_rows_is_the_same_with_the_kernel_and_without(monkeypatch):
    got = [fg.greedy_rows(x) for x in cases(1)]
    monkeypatch.setattr(fg, "load_argmax_kernels", lambda: None)
    assert [fg.greedy_rows(x) for x in cases(1)] == got == [reference(x) for x in cases(1)]
    # and a layout the kernel does not take goes to torch's ops (a transposed view)
    x = torch.randn(5, 3)
    assert fg.greedy_rows(x.t()) == reference(x.t().contiguous())
