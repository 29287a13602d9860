"""Grouping by expert and the combination of expert outputs (fiddler.executors.routing): the combination
gives the bits of transformers' way (a scatter into [T, K, H] of y * w in the model dtype, then a sum
over K), whatever order and pieces the outputs come in, signed zeros included."""
from __future__ import annotations

import pytest
import torch

from fiddler.executors.routing import ExpertGroups, Scratch, SlotOutputs, fixed_size_counts


def scatter_then_sum(T, K, tok, slot, y, w):
    slots = torch.empty(T, K, y.shape[1], dtype=torch.result_type(y, w))
    slots[tok, slot] = y * w[tok, slot].unsqueeze(-1)
    return slots.sum(dim=1)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])  # fp32 weights promote the products
@pytest.mark.parametrize("T,K,E", [(512, 2, 8), (7, 2, 8), (33, 4, 16), (5, 1, 4), (64, 8, 64)])
def test_combination_has_the_bits_of_scatter_then_sum(T, K, E, w_dtype):
    g = torch.Generator().manual_seed(T * K)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).to(w_dtype)
    # a wide exponent range (roundings of every size) and signed zeros (-0 + -0 is -0, a sum from +0 is +0)
    y = (torch.randn(T * K, 96, generator=g) * torch.exp(torch.randn(T * K, 96, generator=g) * 4)).to(torch.bfloat16)
    y[::3] = -0.0
    w[0] = 0.0
    groups = ExpertGroups(idx, E, layer=0)
    tok, slot = groups.pairs_of(groups.active())
    want = scatter_then_sum(T, K, tok, slot, y, w)
    x = torch.empty(T, 96, dtype=torch.bfloat16)
    y_before = y.clone()
    for scratch in (None, Scratch()):
        whole = SlotOutputs(x, K, scratch)
        whole.put(tok, slot, y, w)
        got = whole.sum()
        assert got.dtype == want.dtype and torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                                                       want.view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(y.view(torch.int16), y_before.view(torch.int16))  # the outputs put are not changed
    pieces, start = SlotOutputs(x, K, Scratch()), 0  # expert by expert, as the GPU queue puts them
    for e in reversed(groups.active()):
        te, se = groups.pairs(e)
        rows = torch.cat([torch.nonzero((tok == a) & (slot == b)).flatten() for a, b in zip(te, se)])
        pieces.put(te, se, y[rows], w)
        start += len(te)
    assert start == T * K
    got = pieces.sum()
    assert torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32))


def test_a_missing_output_is_an_error_not_garbage():
    idx = torch.tensor([[0, 1], [1, 2]])
    groups = ExpertGroups(idx, 4, layer=0)
    tok, slot = groups.pairs(1)
    out = SlotOutputs(torch.empty(2, 8, dtype=torch.bfloat16), 2)
    out.put(tok, slot, torch.ones(len(tok), 8, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="2 tokens x 2 slots"):
        out.sum()


def test_scratch_reuses_a_buffer_per_name_and_grows_it():
    s = Scratch()
    a = s.take("a", (4, 8), torch.bfloat16, "cpu")
    assert a.shape == (4, 8) and a.dtype == torch.bfloat16
    assert s.take("a", (2, 8), torch.bfloat16, "cpu").data_ptr() == a.data_ptr()  # smaller: the same memory
    assert s.take("b", (2, 8), torch.bfloat16, "cpu").data_ptr() != a.data_ptr()  # another name: its own
    big = s.take("a", (64, 8), torch.bfloat16, "cpu")
    assert big.shape == (64, 8)
    x = torch.arange(40.0).view(10, 4)
    idx = torch.tensor([9, 0, 3, 3])
    assert torch.equal(s.gather("g", x, idx), x.index_select(0, idx))


def test_fixed_size_counts_are_bincounts_and_reject_bad_ids():
    """The GPU's way of counting (no sync to size the output) gives the CPU's counts; checked here on CPU
    tensors."""
    g = torch.Generator().manual_seed(0)
    for n, E in ((1, 8), (37, 8), (500, 64)):
        flat = torch.randint(0, E, (n,), generator=g)
        assert fixed_size_counts(flat, E, 0) == torch.bincount(flat, minlength=E).tolist()
    for bad in (8, -1, 100):
        with pytest.raises(ValueError, match=f"got {bad} \\(layer 3\\)"):
            fixed_size_counts(torch.tensor([1, bad, 2]), 8, 3)
