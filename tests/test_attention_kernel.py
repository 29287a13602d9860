"""The kernel's causal prefill attention (fiddler/kernels/attention.py, csrc/fk_attention.cpp): against torch's
SDPA and an fp64 reference, on the engine's strided operands, in the engine, and the load-time choice
between it and SDPA (injected timings: nothing here asserts on a measurement)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import fiddler.engine as fe
import fiddler.kernel_loader as kl
from fiddler import Engine
from fiddler.executors import GpuSide
from fiddler.kernels import attention
from tests.models import model_path, prompt

needs_kernel = pytest.mark.skipif(not attention.is_available(), reason="needs the kernel's avx512_bf16 path")


@pytest.fixture(autouse=True)
def _threads_restored():
    import fiddler.kernels as fk

    prev_torch, prev_kernel = torch.get_num_threads(), fk.get_num_threads()
    yield
    torch.set_num_threads(prev_torch)
    fk.set_num_threads(prev_kernel)


def operands(B, nh, nkv, T, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, T, dk, generator=g).to(torch.bfloat16)
    k = torch.randn(B, nkv, T, dk, generator=g).to(torch.bfloat16)
    v = (3 * torch.randn(B, nkv, T, dv, generator=g)).to(torch.bfloat16)
    return q, k, v


def sdpa(q, k, v, scale, dtype=None):
    B, nh, T, _ = q.shape
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=nh != k.shape[1])
    return o.transpose(1, 2).reshape(B * T, -1)


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    e = torch.frexp(x.float().abs().clamp_min(2.0 ** -126)).exponent
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8)


SHAPES = [  # B, nh, nkv, T, dk, dv
    (1, 4, 2, 1, 16, 16),
    (1, 4, 2, 7, 16, 16),
    (2, 6, 3, 33, 64, 64),
    (3, 4, 1, 40, 48, 48),
    (1, 16, 4, 600, 128, 128),  # two key blocks of 512, the second with a tail past its 16-key chunks
    (1, 2, 2, 1030, 96, 96),  # no GQA, three key blocks
    (2, 8, 8, 513, 16, 16),  # a second block of one key
]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_as_close_to_fp64_as_torchs_flash_attention_and_mostly_its_bits(shape):
    # The softmax is torch's (fexp_u20 over 16-key chunks, expf tails, p in bf16); only the summation order
    # inside the two products differs. Measured (Zen 5): the same mean and max error against fp64 as SDPA's,
    # and at most 0.01% of outputs more than one bf16 step from SDPA's (cancellation near zero).
    q, k, v = operands(*shape)
    scale = shape[4] ** -0.5
    got, ref = attention.causal_attention(q, k, v, scale), sdpa(q, k, v, scale)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    exact = sdpa(q, k, v, scale, torch.float64)
    err_got, err_ref = (got.double() - exact).abs(), (ref.double() - exact).abs()
    assert float(err_got.mean()) <= 1.02 * float(err_ref.mean()) + 1e-9
    assert float(err_got.max()) <= 1.25 * float(err_ref.max()) + 1e-9
    beyond_a_step = (got.float() - ref.float()).abs() > bf16_step(ref)
    assert float(beyond_a_step.float().mean()) <= 1e-3


def test_key_and_value_heads_of_different_widths_are_left_to_torch():
    q, k, v = operands(1, 2, 2, 8, 192, 128)  # MLA: SDPA's math path there, not the flash kernel's rounding
    assert not attention.supports(q, k, v)


@needs_kernel
def test_the_engines_strided_views_give_the_bits_of_dense_copies_on_any_thread_count():
    # The engine passes q as a transposed view of its fused qkv rows and k/v as the first T positions of
    # a KV cache with room for more; every tile is independent, so threads do not change a bit.
    B, nh, nkv, T, d, max_seq = 2, 8, 2, 70, 32, 96
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(B, T, nh + 2 * nkv, d, generator=g).to(torch.bfloat16)
    cache_k = torch.randn(B, nkv, max_seq, d, generator=g).to(torch.bfloat16)
    cache_v = torch.randn(B, nkv, max_seq, d, generator=g).to(torch.bfloat16)
    q = qkv[:, :, :nh].transpose(1, 2)
    k, v = cache_k[:, :, :T], cache_v[:, :, :T]
    assert not q.is_contiguous() and not k.is_contiguous()
    dense = attention.causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.2, threads=1)
    assert torch.equal(attention.causal_attention(q, k, v, 0.2, threads=1), dense)
    assert torch.equal(attention.causal_attention(q, k, v, 0.2, threads=2), dense)


def test_operands_it_does_not_take_are_refused():
    q, k, v = operands(1, 4, 2, 8, 16, 16)
    assert attention.supports(q, k, v)
    assert not attention.supports(q.float(), k.float(), v.float())
    assert not attention.supports(q[..., :8], k[..., :8], v[..., :8])  # d not a multiple of 16
    assert not attention.supports(q[:, :3], k, v)  # 3 query heads over 2 KV heads
    assert not attention.supports(q, k[:, :, :4], v[:, :, :4])  # keys other than the queries' positions
    if attention.is_available():
        with pytest.raises(ValueError, match="unsupported operands"):
            attention.causal_attention(q[..., :8], k[..., :8], v[..., :8], 0.25)


# ---------------------------------------------------------------- the choice at load, on injected timings


class Clock:
    def __init__(self):
        self.now = 0.0

    def thread_time(self):
        return self.now


@pytest.mark.parametrize("kernel_cost,torch_cost,path", [(1.0, 3.0, "kernel"), (3.0, 1.0, "torch")])
def test_the_faster_of_the_kernel_and_sdpa_is_kept(monkeypatch, kernel_cost, torch_cost, path):
    clock = Clock()
    fake = types.SimpleNamespace(supports=lambda q, k, v: True,
                                 causal_attention=lambda *a, **kw: setattr(clock, "now", clock.now + kernel_cost))
    monkeypatch.setattr(kl, "load_attention_kernel", lambda: fake)
    monkeypatch.setattr(fe, "time", types.SimpleNamespace(thread_time=clock.thread_time))
    monkeypatch.setattr(fe, "F", types.SimpleNamespace(
        scaled_dot_product_attention=lambda *a, **kw: setattr(clock, "now", clock.now + torch_cost)))
    from fiddler.config import MoEConfig

    cfg = MoEConfig.from_pretrained(model_path("e8k2"))
    got = fe.choose_prefill_attention(cfg, tokens=8)
    assert got["path"] == path
    assert (got["kernel_ms"], got["torch_ms"]) == (kernel_cost * 1e3, torch_cost * 1e3)


def test_no_kernel_path_means_sdpa_and_a_forced_kernel_says_why(monkeypatch):
    monkeypatch.setattr(kl, "load_attention_kernel", lambda: None)
    e = Engine.from_pretrained(model_path("e8k2"), gpu=GpuSide.none(), cpu_threads=2)
    assert e.info()["prefill_attention"]["path"] == "torch" and e.model.prefill_attention is None
    with pytest.raises(ValueError, match="prefill_attention='kernel' cannot be used here: no AVX512-BF16"):
        Engine.from_pretrained(model_path("e8k2"), gpu=GpuSide.none(), cpu_threads=2, prefill_attention="kernel")
    with pytest.raises(ValueError, match="must be one of"):
        Engine.from_pretrained(model_path("e8k2"), gpu=GpuSide.none(), prefill_attention="fast")


# ---------------------------------------------------------------- in the engine


@needs_kernel
@pytest.mark.parametrize("arch", ["e8k2", "hd_tied", "olmoe"])
def test_engine_logits_agree_whichever_side_runs_the_prefill_attention(arch):
    # A speed choice: the kernel's attention and SDPA agree to a bf16 step per output, so the logits of a
    # whole prefill agree far inside test_model_numerics' 3%-of-scale band against transformers.
    vocab = {"e8k2": 512, "hd_tied": 384}.get(arch)
    kernel = Engine.from_pretrained(model_path(arch), gpu=GpuSide.none(), cpu_threads=2, prefill_attention="kernel")
    sdpa_ = Engine.from_pretrained(model_path(arch), gpu=GpuSide.none(), cpu_threads=2, prefill_attention="torch")
    assert kernel.info()["prefill_attention"]["path"] == "kernel" and kernel.model.prefill_attention is not None
    assert sdpa_.model.prefill_attention is None
    calls = []
    ka = kernel.model.prefill_attention
    kernel.model.prefill_attention = types.SimpleNamespace(
        supports=ka.supports, causal_attention=lambda *a, **kw: (calls.append(a[0].shape), ka.causal_attention(*a, **kw))[1])
    ids = prompt(100, vocab or kernel.config.vocab_size)
    a, b = kernel.forward_logits(ids), sdpa_.forward_logits(ids)
    assert len(calls) == kernel.config.num_layers  # every layer's prompt attention went to the kernel
    scale = float(b.abs().max())
    assert float((a - b).abs().max()) < 0.01 * scale
