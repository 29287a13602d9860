"""Beams (issue 21): a decode step reads each distinct expert its beams route to once, and the decode bound
counts those reads, checked against the routing recorder (fiddler.sim.trace.RoutingRecorder)."""

from __future__ import annotations

import pytest

from fiddler import Engine
from fiddler.executors import GpuSide
from fiddler.sim.trace import RoutingRecorder
from tests.models import model_path, prompt


@pytest.fixture(scope="module")
def beams():
    """One beam-search generate on Fiddler's executor with the CPU kernel (bf16, no GPU): the experts each
    executor call read through the kernel, the recorded routing, and the output's stats."""
    e = Engine.from_pretrained(model_path("e8k2"), gpu=GpuSide.none(), max_batch=4)
    ex = e.executor
    recorder = ex.attach_recorder(RoutingRecorder.for_config(e.config))
    expert_of = {id(p): j for row in ex.packed for j, p in enumerate(row) if p is not None}
    assert len(expert_of) == e.config.num_moe_layers * e.config.expert_slots  # every expert on the kernel
    kernel = type(ex.packed[0][0])
    reads: list[list[int]] = []  # per executor call: the experts whose weights the kernel streamed
    kernel_forward, executor_forward = kernel.forward, ex.forward

    def counted(self, *a, **kw):
        reads[-1].append(expert_of[id(self)])
        return kernel_forward(self, *a, **kw)

    def forward(layer, x, idx, w, **kw):
        reads.append([])
        return executor_forward(layer, x, idx, w, **kw)

    ex.forward = forward
    kernel.forward = counted
    try:
        out = e.generate(prompt(9, 512), max_new_tokens=6, beam_width=4)
    finally:
        kernel.forward = kernel_forward
    return e.config, reads, recorder.trace().steps, out.stats


def test_each_expert_the_beams_route_to_is_read_once_per_step(beams):
    cfg, reads, steps, _ = beams
    L = cfg.num_moe_layers
    assert len(steps) == 6 and steps[1].shape[1] == 4  # the prefill, then 5 decode steps of 4 rows
    decode_reads = reads[L:]  # the prefill's L calls come first
    assert len(decode_reads) == 5 * L
    for s, step in enumerate(steps[1:]):
        for layer in range(L):
            routed = set(step[layer].ravel().tolist())
            assert sorted(decode_reads[s * L + layer]) == sorted(routed), (s, layer)  # each once, no other


def test_the_decode_bound_counts_each_steps_distinct_experts_per_layer(beams):
    cfg, _, steps, stats = beams
    distinct = [len(set(step[layer].ravel().tolist())) for step in steps[1:] for layer in range(cfg.num_moe_layers)]
    assert stats["decode_experts_per_layer"] == pytest.approx(sum(distinct) / len(distinct))
    assert cfg.top_k < stats["decode_experts_per_layer"] <= cfg.expert_slots  # 4 beams share some experts


@pytest.mark.parametrize("start", [0, 4, 10])
@pytest.mark.parametrize("beam_idx", [[0, 1, 2, 3], [1, 0, 3, 2], [0, 0, 1, 2], [3, 3, 3, 3], [2, 1, 0, 0]])
def test_the_kv_reorder_copies_the_rows_that_change_into_every_beam(beam_idx, start):
    # Only moved rows are copied; the result is every row b holding old row beam_idx[b] (swaps, several beams
    # from one row, rows that keep their own) on positions [start, 10), every other position untouched.
    import torch

    from fiddler.config import MoEConfig
    from fiddler.model import KVCache

    cfg = MoEConfig.from_pretrained(model_path("e8k2"))
    cache = KVCache(cfg, 4, 16, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    k0, v0 = cache.k.clone(), cache.v.clone()
    idx = torch.tensor(beam_idx)
    cache.reorder(idx, 10, start=start)
    for new, old in ((cache.k, k0), (cache.v, v0)):
        assert torch.equal(new[:, :, :, start:10], old[:, :, :, start:10].index_select(1, idx))
        assert torch.equal(new[:, :, :, :start], old[:, :, :, :start])
        assert torch.equal(new[:, :, :, 10:], old[:, :, :, 10:])
