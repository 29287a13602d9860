"""fiddler.kernels.layout describes the CPU kernel's packed layouts: its sizes equal the C++ packer's and
unpacking what the C++ packer wrote gives back the weights (bf16) or block bytes (Q8_0, Q4_0) bit for bit."""

from __future__ import annotations

import pytest
import torch

from fiddler.kernel_loader import load_kernels
from fiddler.kernels import layout

fk = load_kernels()
pytestmark = pytest.mark.skipif(fk is None, reason="kernel library not built")
SHAPES = [(64, 96), (100, 72), (33, 70), (5632 // 8, 2048 // 8), (1, 1), (47, 1000)]


@pytest.mark.parametrize("ffn,hidden", SHAPES)
def test_bf16_expert_round_trips(ffn, hidden):
    g = torch.Generator().manual_seed(ffn * 1000 + hidden)
    w1, w3 = (torch.randn(ffn, hidden, generator=g).to(torch.bfloat16) for _ in range(2))
    w2 = torch.randn(hidden, ffn, generator=g).to(torch.bfloat16)
    w13, p2 = fk.PackedExpert(w1, w3, w2).packed()
    assert (w13.numel(), p2.numel()) == layout.expert_packed_bytes(hidden, ffn)
    assert w13.numel() == fk._L().fk_packed_bytes(ffn, hidden, 2)
    u1, u3 = layout.unpack(w13, ffn, hidden, 2)
    (u2,) = layout.unpack(p2, hidden, ffn, 1)
    assert torch.equal(u1, w1) and torch.equal(u3, w3) and torch.equal(u2, w2)
    dst = [torch.empty_like(w1), torch.empty_like(w3)]
    layout.unpack_into(dst, w13, ffn, hidden)
    assert torch.equal(dst[0], w1) and torch.equal(dst[1], w3)
    # and back: a packed expert made from the buffers is the same expert
    again = fk.PackedExpert.from_packed(hidden, ffn, w13, p2)
    x = torch.randn(3, hidden, generator=g).to(torch.bfloat16)
    assert torch.equal(again(x), fk.PackedExpert(w1, w3, w2)(x))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("ffn,hidden", [s for s in SHAPES if s != (1, 1)])
def test_quantized_expert_round_trips(fmt, ffn, hidden):
    g = torch.Generator().manual_seed(ffn + hidden)
    e = fk.quant.QuantExpert.from_float(torch.randn(ffn, hidden, generator=g), torch.randn(ffn, hidden, generator=g),
                                        torch.randn(hidden, ffn, generator=g), fmt)
    b1, b3, b2 = e.blocks()  # the C++ unpacker's answer
    w13, p2 = e.packed()
    assert (w13.numel(), p2.numel()) == layout.expert_packed_bytes(hidden, ffn, fmt)
    u1, u3 = layout.unpack(w13, ffn, hidden, 2, fmt)
    (u2,) = layout.unpack(p2, hidden, ffn, 1, fmt)
    assert torch.equal(u1, b1) and torch.equal(u3, b3) and torch.equal(u2, b2)
    dst = [torch.empty_like(b2)]
    layout.unpack_into(dst, p2, hidden, ffn, fmt)
    assert torch.equal(dst[0], b2)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="uint8 bytes"):
        layout.unpack(torch.zeros(10, dtype=torch.uint8), 4, 4, 1)
