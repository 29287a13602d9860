"""The router's top-k in C (fiddler.kernels.route, csrc/fk_route.cpp) and the executor's decode row through an
ExpertTable: the bits of the torch ops they replace, on generated scores with ties, NaN and underflow, and
route() the same whether the kernel serves a call or torch does."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fiddler.model as fm
from fiddler.config import MoEConfig
from fiddler.kernel_loader import load_kernels, load_route_kernels

kr = load_route_kernels()
needs_kernel = pytest.mark.skipif(kr is None, reason="kernel library not built")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def torch_topk(scores: torch.Tensor, K: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route()'s torch ops after the softmax."""
    w, idx = torch.topk(scores, K, dim=-1, sorted=True)
    if renorm:
        w /= w.sum(dim=-1, keepdim=True)
    return idx, w.to(torch.bfloat16)


def ambiguous(row: torch.Tensor, K: int) -> bool:
    """A NaN, or equal scores among the top K or at its edge."""
    if torch.isnan(row).any():
        return True
    top = torch.topk(row, K).values
    return len(set(top.tolist())) < K or int((row == top[-1]).sum()) > 1


def cases(n: int, seed: int = 0):
    """(scores, K, renorm): softmax outputs of bf16 logits at many scales (large ones underflow to zeros,
    which tie), rows of integer logits (ties at and inside the top k), a NaN row."""
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        E = (4, 8, 16, 60, 64, 128, 160)[i % 7]
        K = min(E, (1, 2, 1, 2, 4, 8)[i % 6])
        renorm = K <= 2 and i % 5 != 0
        rows = 1 + i % 4
        logits = torch.randn(rows, E, generator=g) * (0.01, 1.0, 10.0, 300.0)[i % 4]
        if i % 6 == 0:
            logits = torch.randint(-3, 3, (rows, E), generator=g).float()
        if i % 29 == 0:
            logits[-1, i % E] = float("nan")
        yield torch.softmax(logits.to(torch.bfloat16), dim=-1, dtype=torch.float32), K, renorm


@needs_kernel
def test_topk_has_the_bits_of_torch_or_declines():
    served = declined = 0
    for scores, K, renorm in cases(3000):
        want_idx, want_w = torch_topk(scores, K, renorm)
        got = kr.topk(scores, K, renorm)
        if got is not None:
            served += 1
            idx, w = got
            assert torch.equal(idx, want_idx), (scores, idx, want_idx)
            assert torch.equal(bits(w), bits(want_w)), (scores, w, want_w)
        else:  # only where torch's answer depends on its order among equal scores (or a NaN)
            declined += 1
            assert any(ambiguous(r, K) for r in scores), scores
    assert served > 1000 and declined > 100  # both sides were exercised


@needs_kernel
def test_ties_decline_and_distinct_scores_are_served():
    for row in ([0.1, 0.4, 0.4, 0.1],  # a tie inside the top 2
                [0.5, 0.2, 0.2, 0.1],  # a tie at the 2nd place
                [1.0, 0.0, 0.0, 0.0],  # underflowed scores tie
                [0.5, float("nan"), 0.3, 0.2]):
        assert kr.topk(torch.tensor([row]), 2, True) is None, row
    idx, w = kr.topk(torch.tensor([[0.1, 0.4, 0.3, 0.2]]), 2, True)
    assert idx.tolist() == [[1, 2]]
    assert torch.equal(bits(w), bits(torch.tensor([[0.4 / 0.7, 0.3 / 0.7]]).to(torch.bfloat16)))


@needs_kernel
def test_topk_checks_its_arguments():
    s = torch.rand(2, 8)
    with pytest.raises(ValueError, match="k <= 2"):
        kr.topk(s, 4, True)  # the sum of more than two has an order
    with pytest.raises(ValueError, match="scores must be a contiguous"):
        kr.topk(s.t().contiguous().t(), 4, False)
    with pytest.raises(ValueError, match="scores must be a contiguous"):
        kr.topk(s.double(), 4, False)
    with pytest.raises(ValueError, match="k must be in"):
        kr.topk(torch.rand(2, 3), 4, False)


MIXTRAL = MoEConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_experts=8, top_k=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, vocab_size=100)
CONFIGS = {
    "top_k int": 2,
    "mixtral": MIXTRAL,
    "top-1": dataclasses.replace(MIXTRAL, top_k=1),
    "no renorm, top-8": dataclasses.replace(MIXTRAL, num_experts=64, top_k=8, norm_topk_prob=False),
    "renorm, top-4 (torch)": dataclasses.replace(MIXTRAL, num_experts=16, top_k=4),
    "unsorted (torch)": dataclasses.replace(MIXTRAL, topk_sorted=False),
    "sigmoid": dataclasses.replace(MIXTRAL, scoring_func="sigmoid"),
    "group limited": dataclasses.replace(MIXTRAL, num_experts=16, topk_method="group_limited_greedy", n_group=4,
                                         topk_group=2, routed_scaling_factor=1.0, norm_topk_prob=False),
}


@needs_kernel
@pytest.mark.parametrize("name", list(CONFIGS))
def test_route_is_the_same_with_and_without_the_kernel(name, monkeypatch):
    cfg = CONFIGS[name]
    E = cfg if isinstance(cfg, int) else cfg.num_experts
    E = 8 if isinstance(cfg, int) else E
    g = torch.Generator().manual_seed(len(name))
    served = []
    real = fm._topk_in_kernel
    for i in range(300):
        rows = (1, 1, 3, 17)[i % 4]
        logits = (torch.randn(rows, E, generator=g) * (0.1, 1.0, 30.0)[i % 3]).to(torch.bfloat16)
        if i % 10 == 0:
            logits = torch.randint(-2, 2, (rows, E), generator=g).to(torch.bfloat16)
        monkeypatch.setattr(fm, "_topk_in_kernel", lambda *a: served.append(real(*a)) or served[-1])
        idx, w = fm.route(logits, cfg, torch.bfloat16)
        monkeypatch.setattr(fm, "_topk_in_kernel", lambda *a: None)
        want_idx, want_w = fm.route(logits, cfg, torch.bfloat16)
        assert torch.equal(idx, want_idx) and w.dtype == want_w.dtype and torch.equal(bits(w), bits(want_w))
    n = sum(s is not None for s in served)
    if "(torch)" in name:
        assert n == 0
    else:
        assert 0 < n < len(served)  # served most calls, declined the ties


def test_route_without_the_kernel_or_for_fp32_is_torchs(monkeypatch):
    logits = torch.randn(3, 8).to(torch.bfloat16)
    monkeypatch.setattr(fm, "load_route_kernels", lambda: None)
    idx, w = fm.route(logits, MIXTRAL, torch.bfloat16)
    assert torch.equal(idx, torch.topk(logits.float(), 2).indices)
    monkeypatch.undo()
    assert fm._topk_in_kernel(torch.rand(1, 8), 2, True, torch.float32) is None


@pytest.mark.skipif(load_kernels() is None, reason="kernel library not built")
def test_expert_table_row_has_the_bits_of_moe_ffn_residual():
    k = load_kernels()
    g = torch.Generator().manual_seed(5)
    H, F_, E = 64, 96, 6

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)

    experts = [k.PackedExpert(w(F_, H), w(F_, H), w(H, F_)) if e != 3 else None for e in range(E)]
    table = k.ExpertTable(experts)
    for ids in ([0, 5], [2], [5, 0, 1, 4]):
        x, res = w(1, H) * 10, w(1, H) * 10
        weights = torch.rand(len(ids), generator=g).to(torch.bfloat16)
        want = k.moe_ffn_residual([experts[e] for e in ids], weights, x, res)
        got = table.residual_row(ids, weights.view(1, -1), x, res, threads=1)
        assert torch.equal(bits(got), bits(want))
    x, res, weights = w(1, H), w(1, H), torch.ones(2, dtype=torch.bfloat16)
    for bad in ([0, 3], [0, 6], [-1, 0], []):
        with pytest.raises(ValueError, match="expert ids"):
            table.residual_row(bad, weights[:len(bad)], x, res)
    with pytest.raises(ValueError, match="residual must be"):
        table.residual_row([0, 1], weights, x, w(2, H))
    with pytest.raises(ValueError, match="weights must be"):
        table.residual_row([0, 1], weights.float(), x, res)
    with pytest.raises(ValueError, match="x must be"):
        table.residual_row([0, 1], weights, w(1, H).t().contiguous().t()[:, :H - 1], res)
