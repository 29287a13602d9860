"""fiddler.kernels: every compiled path against an fp64 reference, input validation, threading,
the forced fallback, and a run under an emulated Haswell CPU (no AVX-512) to prove the run-time
dispatch never executes an instruction the CPU lacks."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fiddler.kernels as fk

pytestmark = pytest.mark.skipif(not fk.is_available(), reason=f"kernel library not built: {fk.load_error()}")

FEATS = fk.features() if fk.is_available() else {}
PATHS = [
    pytest.param("avx512_bf16", marks=pytest.mark.skipif(FEATS.get("best_isa") != "avx512_bf16", reason="no AVX512-BF16")),
    pytest.param("avx512", marks=pytest.mark.skipif(FEATS.get("best_isa") not in ("avx512", "avx512_bf16"),
                                                    reason="no AVX-512 F/BW/VL/DQ")),
    pytest.param("avx2", marks=pytest.mark.skipif(FEATS.get("best_isa") not in ("avx2", "avx512", "avx512_bf16"),
                                                  reason="no AVX2")),
    "generic",
    "amx_emulated",
    pytest.param("amx", marks=pytest.mark.skipif(not FEATS.get("amx_supported"), reason="no AMX-BF16 on this CPU")),
]


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    fk.set_isa("auto")


def use_path(path: str) -> None:
    if path == "amx_emulated":
        fk.set_isa("generic" if FEATS["best_isa"] == "generic" else FEATS["best_isa"])
        fk.set_amx("emulated", 1)  # every token count goes through the tile code
    elif path == "amx":
        fk.set_isa("amx")
        fk.set_amx("on", 1)
    else:
        fk.set_isa(path)


def rand_bf16(*shape, scale=1.0, gen):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def expert_case(hidden, ffn, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = rand_bf16(tokens, hidden, gen=g)
    w1, w3 = rand_bf16(ffn, hidden, scale=hidden**-0.5, gen=g), rand_bf16(ffn, hidden, scale=hidden**-0.5, gen=g)
    w2 = rand_bf16(hidden, ffn, scale=ffn**-0.5, gen=g)
    return x, w1, w3, w2


def check_expert(y, x, w1, w3, w2):
    """Bound for bf16 inputs, fp32 accumulation, h and y rounded to bf16 once each:
    |y - ref| <= 2^-9 |W2| |h| (h rounding) + 2^-9 |ref| (y rounding), checked with 2x slack."""
    xd, w1d, w3d, w2d = (t.double() for t in (x, w1, w3, w2))
    h = torch.nn.functional.silu(xd @ w1d.T) * (xd @ w3d.T)
    ref = h @ w2d.T
    mag = h.abs() @ w2d.abs().T
    err = (y.double() - ref).abs()
    bound = 2**-8 * mag + 2**-8 * ref.abs() + 1e-6 * mag.max()
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    worst = (err - bound).max().item()
    assert worst <= 0, f"max error over bound {worst:.3g} (max err {err.max().item():.3g})"


SHAPES = [(64, 128), (100, 300), (33, 17), (1, 1), (4096, 64), (96, 2080)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hidden,ffn", SHAPES)
def test_expert_ffn_matches_reference(path, hidden, ffn):
    use_path(path)
    for tokens in (1, 2, 7, 16, 33, 257):
        if path == "amx_emulated" and hidden * ffn * tokens > 3_000_000:
            continue  # the software tiles are slow; large cases are covered by the vector paths
        x, w1, w3, w2 = expert_case(hidden, ffn, tokens, seed=tokens)
        check_expert(fk.PackedExpert(w1, w3, w2)(x), x, w1, w3, w2)


@pytest.mark.parametrize("path", PATHS)
def test_a_rows_result_does_not_depend_on_the_other_rows_of_its_call(path):
    """Many rows go through the GEMM-style blocking (super-blocks of 8 weight blocks, token chunks of 64-256
    rows, K chunks of 256-2048; AVX512-BF16: two blocks a micro-kernel call), one row (AMX: up to 96) through a
    single stream of one block at a time; both sum each output in the same order, so each row's bits are the
    same alone or among 270 (several token chunks, two super-blocks, several K chunks: 3 of 2048 on
    AVX512-BF16 with 1 MiB of L2)."""
    use_path(path)
    hidden, ffn, tokens = {"generic": (600, 300, 40), "avx512_bf16": (4200, 300, 270)}.get(path, (1100, 300, 270))
    x, w1, w3, w2 = expert_case(hidden, ffn, tokens, seed=11)
    pe = fk.PackedExpert(w1, w3, w2)
    lin = fk.PackedLinear(w1)
    y, z = pe(x), lin.forward(x)
    for n in (33, 64, 90):  # AMX: up to 96 rows in one pass over each block (block_product), not blocked
        assert torch.equal(pe(x[:n].clone()), y[:n]) and torch.equal(lin.forward(x[:n].clone()), z[:n]), n
    for t in (0, 1, 37, 255, 256, tokens - 1):
        if t < tokens:
            assert torch.equal(pe(x[t:t + 1].clone()), y[t:t + 1]), f"expert row {t}"
            assert torch.equal(lin.forward(x[t:t + 1].clone()), z[t:t + 1]), f"linear row {t}"
    many = fk.moe_ffn([pe, pe], torch.tensor([0.25, 0.75], dtype=torch.bfloat16), x)
    one = fk.moe_ffn([pe, pe], torch.tensor([0.25, 0.75], dtype=torch.bfloat16), x[5:6].clone())
    assert torch.equal(many[5:6], one)


@pytest.mark.parametrize("path", PATHS)
def test_results_do_not_depend_on_the_super_blocks(path):
    """The number of weight blocks a many-token product walks K with (tune_blocking's knob) changes which
    blocks share a pass, never the order of any output's sum: the same bits for every setting."""
    use_path(path)
    hidden, ffn, tokens = (1100, 300, 270) if path != "generic" else (600, 300, 40)
    x, w1, w3, w2 = expert_case(hidden, ffn, tokens, seed=5)
    pe, lin = fk.PackedExpert(w1, w3, w2), fk.PackedLinear(w1)
    try:
        fk.set_super_blocks(None)
        want_e, want_l = pe(x), lin.forward(x)
        for n in (1, 2, 3, 16):
            fk.set_super_blocks(n)
            assert fk.blocking()["super_blocks"] == n == fk.blocking_choice()["super_blocks"]
            assert torch.equal(pe(x), want_e), f"expert, {n} super-blocks"
            assert torch.equal(lin.forward(x), want_l), f"linear, {n} super-blocks"
    finally:
        fk.set_super_blocks(None)
    assert fk.blocking_choice() == {"super_blocks": 8, "source": "default"}
    with pytest.raises(ValueError, match="super-blocks"):
        fk.set_super_blocks(-1)


def test_fastest_blocking_is_chosen_per_token_count():
    got = fk.fastest_blocking({2: {64: 19.0, 256: 49.0, 512: 19.1}, 4: {64: 20.0, 256: 49.0, 512: 18.2},
                               8: {64: 26.0, 256: 55.0, 512: 18.5}})
    assert got == {64: 2, 256: 4, 512: 4}  # a tie (256) keeps the larger candidate


def test_super_blocks_per_token_count():
    try:
        fk.set_super_blocks({64: 2, 256: 4})
        assert [fk.super_blocks_for(t) for t in (1, 64, 65, 256, 4096)] == [2, 2, 4, 4, 4]
        assert fk.blocking_choice() == {"super_blocks": {64: 2, 256: 4}, "source": "set_super_blocks"}
        fk.set_super_blocks(3)
        assert fk.super_blocks_for(1) == fk.super_blocks_for(10**6) == 3 == fk.blocking()["super_blocks"]
        for bad in (0.5, {64: 0}, {0: 2}, 65, {64: 2.0}):
            with pytest.raises(ValueError, match="super-blocks"):
                fk.set_super_blocks(bad)
    finally:
        fk.set_super_blocks(None)
    assert fk.super_blocks_for(64) == 8 and fk.blocking_choice() == {"super_blocks": 8, "source": "default"}


def test_blocking_tuning_measures_sets_and_can_be_overridden(monkeypatch):
    import types

    e = fk.PackedExpert(*(torch.ones(64, 32, dtype=torch.bfloat16),) * 2, torch.ones(32, 64, dtype=torch.bfloat16))
    try:
        # a few KB cannot show the DRAM regime: nothing is measured, the default stays
        assert fk.tune_blocking([e]) == {"super_blocks": 8, "source": "default"}
        monkeypatch.setattr(fk.probe, "llc_bytes", lambda: 0)
        # injected times, per token count (64, then 256), per candidate (2, 8): 2 wins at 64, 8 at 256
        clock = _ScriptedClock([2e-3, 3e-3, 6e-3, 5e-3])
        monkeypatch.setattr(fk.timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
        got = fk.tune_blocking([e] * 4, candidates=(2, 8), tokens=(64, 256), rounds=1)
        assert not clock.durations
        assert got["source"].startswith("tune_blocking: measured on 4 experts") and got["super_blocks"] == {64: 2, 256: 8}
        assert got["ms"] == {2: {64: 2.0, 256: 6.0}, 8: {64: 3.0, 256: 5.0}}
        assert (fk.super_blocks_for(32), fk.super_blocks_for(100), fk.super_blocks_for(5000)) == (2, 8, 8)
        monkeypatch.setenv("FIDDLER_KERNEL_SUPER_BLOCKS", "4")
        assert fk.tune_blocking([e]) == {"super_blocks": 4, "source": "FIDDLER_KERNEL_SUPER_BLOCKS"}
    finally:
        fk.set_super_blocks(None)


def test_many_token_blocking_is_derived_from_the_caches():
    """K chunk: a 32-row block's piece within 2/3 of L1d; token chunk: a super-block's accumulators and
    the rows' piece within 3/8 of L2 (fk_tuning.cpp)."""
    assert fk.blocking(48 << 10, 2 << 20) == {"k_chunk": 512, "token_chunk": 256, "super_blocks": 8,
                                               "l1d": 48 << 10, "l2": 2 << 20}
    assert fk.blocking(32 << 10, 256 << 10)["k_chunk"] == 256 and fk.blocking(32 << 10, 256 << 10)["token_chunk"] == 32
    assert fk.blocking(48 << 10, 1 << 20)["token_chunk"] == 128
    assert fk.blocking(1 << 20, 64 << 20)["k_chunk"] == 2048 and fk.blocking(1 << 20, 64 << 20)["token_chunk"] == 512
    here = fk.features()["blocking"]
    assert here["k_chunk"] in (128, 256, 512, 1024, 2048) and here["token_chunk"] % 32 == 0 and here["l1d"] > 0


@pytest.mark.parametrize("path", ["amx_emulated", PATHS[-1]])
def test_no_tile_state_outlives_a_call(path):
    """The tile palette is loaded once per thread and region; torch's own AMX GEMM (oneDNN configures
    tiles its own way) between two calls on the same thread must change nothing."""
    use_path(path)
    x, w1, w3, w2 = expert_case(256, 200, 70, seed=5)
    pe = fk.PackedExpert(w1, w3, w2)
    first = pe(x)
    for threads in (1, None):
        a = torch.randn(300, 512).to(torch.bfloat16)
        torch.nn.functional.linear(a, torch.randn(700, 512).to(torch.bfloat16))  # oneDNN, AMX where present
        assert torch.equal(pe.forward(x, threads=threads), first)


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=25, deadline=None)
@given(hidden=st.integers(1, 160), ffn=st.integers(1, 200), tokens=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_expert_ffn_random_shapes(path, hidden, ffn, tokens, seed):
    use_path(path)
    x, w1, w3, w2 = expert_case(hidden, ffn, tokens, seed)
    check_expert(fk.PackedExpert(w1, w3, w2)(x), x, w1, w3, w2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,bias", [(8, 4096, False), (130, 97, True), (1, 1, True), (300, 64, False)])
def test_packed_linear_matches_reference(path, out_dtype, n, k, bias):
    use_path(path)
    g = torch.Generator().manual_seed(n * k)
    w = rand_bf16(n, k, scale=k**-0.5, gen=g)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    lin = fk.PackedLinear(w, b)
    for tokens in (1, 5, 16, 40):
        x = rand_bf16(tokens, k, gen=g)
        y = lin.forward(x, out_dtype=out_dtype)
        ref = x.double() @ w.double().T + (b.double() if bias else 0)
        mag = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
        # fp32 accumulation over k terms, then (bf16 output) one rounding
        bound = 1e-5 * mag + (2**-8 * ref.abs() if out_dtype == torch.bfloat16 else 0) + 1e-7
        assert y.dtype == out_dtype and y.shape == (tokens, n)
        assert ((y.double() - ref).abs() <= bound).all()


def test_paths_agree_and_threads_do_not_change_results():
    x, w1, w3, w2 = expert_case(300, 700, 45, seed=3)
    pe = fk.PackedExpert(w1, w3, w2)
    y1 = pe.forward(x, threads=1)
    assert torch.equal(y1, pe.forward(x, threads=2)) and torch.equal(y1, pe.forward(x, threads=7))
    assert pe.nbytes >= 3 * 300 * 700 * 2 and (pe.hidden, pe.ffn) == (300, 700)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hidden,ffn,tokens,n", [(64, 96, 1, 2), (100, 300, 1, 4), (33, 17, 3, 3), (96, 2080, 13, 2)])
def test_moe_ffn_equals_per_expert_combine(path, hidden, ffn, tokens, n):
    """moe_ffn (all experts of a decode step in one call) rounds exactly like the executor's torch
    combine of per-expert results: (y_e * w_e) in bf16, summed over experts with one rounding."""
    use_path(path)
    g = torch.Generator().manual_seed(hidden + n)
    experts = [fk.PackedExpert(*expert_case(hidden, ffn, 1, seed=hidden * 10 + e)[1:]) for e in range(n)]
    x = rand_bf16(tokens, hidden, gen=g)
    w = torch.softmax(torch.randn(n, generator=g), 0).to(torch.bfloat16)
    ref = torch.stack([e.forward(x) * w[i] for i, e in enumerate(experts)], 1).sum(1)
    out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16)
    assert fk.moe_ffn(experts, w, x, out=out) is out
    assert torch.equal(out, ref)
    assert torch.equal(fk.moe_ffn(experts, w, x, threads=1), ref)


def test_moe_ffn_bad_inputs_raise():
    _, w1, w3, w2 = expert_case(64, 96, 1)
    a, b = fk.PackedExpert(w1, w3, w2), fk.PackedExpert(w1[:, :32].contiguous(), w3[:, :32].contiguous(), w2[:32].contiguous())
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w2x = torch.ones(2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at least one"):
        fk.moe_ffn([], w2x, x)
    with pytest.raises(ValueError, match="share one shape"):
        fk.moe_ffn([a, b], w2x, x)
    with pytest.raises(ValueError, match="one entry per expert"):
        fk.moe_ffn([a, a], torch.ones(3, dtype=torch.bfloat16), x)
    with pytest.raises(TypeError, match="bfloat16"):
        fk.moe_ffn([a, a], torch.ones(2), x)
    with pytest.raises(ValueError, match=r"\[tokens, 64\]"):
        fk.moe_ffn([a, a], w2x, torch.zeros(1, 65, dtype=torch.bfloat16))


def test_out_argument_and_zero_tokens():
    x, w1, w3, w2 = expert_case(64, 96, 5)
    pe = fk.PackedExpert(w1, w3, w2)
    out = torch.full((5, 64), float("nan"), dtype=torch.bfloat16)
    assert pe.forward(x, out=out) is out and torch.equal(out, pe.forward(x))
    assert pe.forward(x[:0]).shape == (0, 64)
    lin = fk.PackedLinear(w1)
    out32 = torch.empty(5, 96)
    assert lin.forward(x, out=out32, out_dtype=torch.float32) is out32


def test_bad_inputs_raise():
    x, w1, w3, w2 = expert_case(64, 96, 4)
    with pytest.raises(TypeError, match="bfloat16"):
        fk.PackedExpert(w1, w3, w2)(x.float())
    with pytest.raises(TypeError, match="bfloat16"):
        fk.PackedExpert(w1.half(), w3, w2)
    with pytest.raises(ValueError, match="shapes disagree"):
        fk.PackedExpert(w1, w3, w2.T.contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        fk.PackedExpert(w1, w3, w1.T)
    pe = fk.PackedExpert(w1, w3, w2)
    with pytest.raises(ValueError, match=r"\[tokens, 64\]"):
        pe.forward(torch.zeros(4, 65, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        pe.forward(x[0])
    with pytest.raises(ValueError, match="contiguous"):
        pe.forward(torch.zeros(64, 4, dtype=torch.bfloat16).T)
    with pytest.raises(ValueError, match="out must be"):
        pe.forward(x, out=torch.empty(3, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="threads"):
        pe.forward(x, threads=0)
    with pytest.raises(TypeError):
        pe.forward([1, 2])
    with pytest.raises(ValueError, match="empty"):
        fk.PackedLinear(torch.zeros(0, 4, dtype=torch.bfloat16))
    lin = fk.PackedLinear(w1)
    with pytest.raises(TypeError, match="out_dtype"):
        lin.forward(x, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="bias"):
        fk.PackedLinear(w1, torch.zeros(3))
    with pytest.raises(ValueError, match="unknown kernel ISA"):
        fk.set_isa("sse9")
    with pytest.raises(ValueError):
        fk.set_num_threads(0)


def test_concurrent_calls_from_python_threads():
    # the library is loaded with ctypes.CDLL, which releases the GIL: concurrent callers share the pool
    # one region at a time, and each gets its own exact result
    x, w1, w3, w2 = expert_case(128, 256, 9, seed=5)
    pe = fk.PackedExpert(w1, w3, w2)
    expected = pe.forward(x)
    results = [None] * 6

    def work(i):
        for _ in range(10):
            results[i] = pe.forward(x)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(r, expected) for r in results)


def test_features_match_cpuinfo_and_threads_setting():
    f = fk.features()
    assert f["isa"] in f["compiled"] and f["best_isa"] in f["compiled"]
    if os.path.exists("/proc/cpuinfo"):
        flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
        for name in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"):
            assert f[name] == (name in flags), name
    before = fk.get_num_threads()
    fk.set_num_threads(1)
    try:
        assert fk.get_num_threads() == 1
    finally:
        fk.set_num_threads(None)
    assert fk.get_num_threads() == before


def test_read_limit_names_every_strategy():
    lim = fk.read_limit(nbytes=32 << 20, threads=2, repeats=1, cached=False)
    names = set(lim["strategies"])
    assert {"read_none_2t", "read_t0_2t", "read_t1_2t", "read_nta_2t", "read_none_1t", "gemv_fp32_2t"} == names
    assert all(0 < v < 10_000 for v in lim["strategies"].values())
    assert lim["gbps"] == max(lim["strategies"].values()) == lim["strategies"][lim["best"]]
    with pytest.raises(ValueError):
        fk.read_limit(nbytes=1000)


def test_read_once_reads_by_every_strategy_and_checks_its_input():
    buf = fk.limit_buffer(8 << 20)
    for s in fk.READ_ONCE_STRATEGIES:
        assert 0 < fk.read_once_gbps(buf, s, threads=1) < 10_000, s
    assert fk.READ_ONCE_STRATEGIES == ("none", "t0", "t1", "nta", "gemv")
    with pytest.raises(ValueError, match="strategy"):
        fk.read_once_gbps(buf, "t2")
    with pytest.raises(TypeError):
        fk.read_once_gbps(buf.view(torch.float32), "t0")
    with pytest.raises(ValueError, match="16 KiB"):
        fk.read_once_gbps(buf[:1000], "gemv")


def test_own_memory_limit_reads_the_copy_half_a_cycle_away_one_strategy_a_round(monkeypatch):
    """The benchmarks' limit side (benchmarks/conftest.py): round i reads copy (i + n/2) mod n, whose
    two weight buffers it times with one strategy, in turn, scaled to the bytes the ratio counts."""
    import types

    from benchmarks.conftest import own_memory_limit

    calls = []

    def fake(buf, strategy, threads=None):
        calls.append((buf, strategy))
        return 2.0  # GB/s

    monkeypatch.setattr(fk, "read_once_gbps", fake)
    copies = [types.SimpleNamespace(_w13=torch.zeros(3000, dtype=torch.uint8) + i,
                                    _w2=torch.zeros(1000, dtype=torch.uint8) + i, nbytes=4000) for i in range(4)]
    side = own_memory_limit(copies, weight_bytes=8000)
    got = [side(i) for i in range(6)]
    assert got == [pytest.approx(8000 / 2e9)] * 6  # 4000 bytes at 2 GB/s, scaled to 8000 bytes
    read = [(int(b[0]), s) for b, s in calls]
    assert [c for c, _ in read[::2]] == [2, 3, 0, 1, 2, 3]  # copy (i + 2) mod 4, both its buffers
    assert [s for _, s in read[::2]] == list(fk.READ_ONCE_STRATEGIES) + ["none"]
    assert [id(b) for b, _ in calls[:2]] == [id(copies[2]._w13), id(copies[2]._w2)]


def test_read_limit_does_not_follow_the_kernel_tuning():
    """The probe judges the kernel: changing the kernel's stream prefetch must not change what it reads."""
    prev = fk.stream()
    try:
        fk.set_stream("nta:4096")
        a = set(fk.read_limit(nbytes=8 << 20, threads=1, repeats=1, cached=False)["strategies"])
        fk.set_stream("none")
        b = set(fk.read_limit(nbytes=8 << 20, threads=1, repeats=1, cached=False)["strategies"])
    finally:
        fk.set_stream(prev["spec"])
    assert a == b == {"read_none_1t", "read_t0_1t", "read_t1_1t", "read_nta_1t", "gemv_fp32_1t"}


def test_stream_tuning_default_override_and_errors():
    d = fk.set_stream("auto")
    assert d["hint"] in fk.HINTS and d["distance"] % 64 == 0 and d["source"].startswith("table")
    assert fk.features()["stream"] == d
    try:
        assert fk.set_stream("t0:1024") == {"hint": "t0", "distance": 1024, "far": 0, "spec": "t0:1024",
                                            "source": "set_stream"}
        assert fk.set_stream("t0:512/4096")["far"] == 4096 and fk.stream()["spec"] == "t0:512/4096"
        assert fk.set_stream("nta")["distance"] == 4096
        for bad in ("t3", "t0:100", "t0:x", "t0:0", "t0:64/100", "t0:64/-64"):
            with pytest.raises(ValueError):
                fk.set_stream(bad)
        assert fk.stream()["hint"] == "nta"  # a refused value changes nothing
    finally:
        fk.set_stream("auto")
    assert fk.stream() == d


@pytest.mark.parametrize("spec", ["none", "t0:64", "t1:4096", "nta:65536", "t0:1024/4096", "none:64/8192"])
def test_every_stream_prefetch_computes_the_same_bits(spec):
    """The prefetch is a hint: every choice gives identical outputs at 1..13 tokens."""
    g = torch.Generator().manual_seed(3)
    w1, w3 = ((torch.randn(96, 160, generator=g) / 12).bfloat16() for _ in range(2))
    w2 = (torch.randn(160, 96, generator=g) / 9).bfloat16()
    e = fk.PackedExpert(w1, w3, w2)
    xs = [torch.randn(t, 160, generator=g).bfloat16() for t in (1, 5, 13)]
    ref = [e(x) for x in xs]
    try:
        fk.set_stream(spec)
        assert all(torch.equal(e(x), r) for x, r in zip(xs, ref))
    finally:
        fk.set_stream("auto")


def test_stream_override_from_the_environment():
    code = "import fiddler.kernels as fk; print(fk.stream())"
    env = {**os.environ, "FIDDLER_KERNEL_STREAM": "t0:2048"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "'spec': 't0:2048', 'source': 'FIDDLER_KERNEL_STREAM'" in out
    env["FIDDLER_KERNEL_STREAM"] = "bogus"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "unknown stream prefetch 'bogus'" in r.stderr


def test_tune_stream_picks_the_fastest_measured_candidate():
    prev = fk.stream()
    try:
        res = fk.tune_stream(candidates=("none", "t0:1024/4096"), nbytes=16 << 20, rounds=1)
        assert set(res["gbps"]) == {"none", "t0:1024/4096"} and res["candidate"] == max(res["gbps"], key=res["gbps"].get)
        st = fk.stream()
        assert st["spec"] == res["chosen"] and st["source"].startswith("tune_stream")
    finally:
        fk.set_stream(prev["spec"])


_SMALL_CALL = """
import torch, fiddler.kernels as fk
torch.manual_seed(0)
x = torch.randn(3, 40).bfloat16(); w1 = (torch.randn(72, 40) / 7).bfloat16()
w3 = (torch.randn(72, 40) / 7).bfloat16(); w2 = (torch.randn(40, 72) / 9).bfloat16()
y = fk.PackedExpert(w1, w3, w2)(x).double()
ref = (torch.nn.functional.silu(x.double() @ w1.double().T) * (x.double() @ w3.double().T)) @ w2.double().T
assert ((y - ref).norm() / ref.norm()).item() < 1e-2
print("ISA", fk.isa())
"""


def run_python(code, env=None, prefix=(), auto_isa=False):
    """code in a child python; auto_isa: without a forced kernel ISA (FIDDLER_KERNEL_ISA) from this process,
    for the tests that check the automatic choice on an emulated CPU."""
    base = {k: v for k, v in os.environ.items() if not (auto_isa and k == "FIDDLER_KERNEL_ISA")}
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**base, **(env or {})})


def test_forced_fallback_by_environment():
    r = run_python(_SMALL_CALL, env={"FIDDLER_KERNEL_ISA": "avx2" if FEATS["best_isa"] != "generic" else "generic"})
    assert r.returncode == 0, r.stderr
    assert "ISA avx2" in r.stdout or "ISA generic" in r.stdout
    bad = run_python("import fiddler.kernels", env={"FIDDLER_KERNEL_ISA": "nope"})
    assert bad.returncode != 0 and "unknown kernel ISA" in bad.stderr


# Without torch: the library alone, loaded by path, on a CPU where torch itself cannot run.
_CTYPES_CALL = """
import ctypes, importlib.util, math, random, struct
spec = importlib.util.spec_from_file_location("fkl", %r)
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
L = m.lib
assert L is not None, m.load_error
rnd = random.Random(0)
def bf(v): return struct.unpack("<I", struct.pack("<f", v))[0] >> 16    # v exact in bf16
def f(b): return struct.unpack("<f", struct.pack("<I", b << 16))[0]
H, F, T = 40, 72, 3
vals = lambda n: [rnd.randint(-8, 8) / 16 for _ in range(n)]
x, w1, w3, w2 = vals(T * H), vals(F * H), vals(F * H), vals(H * F)
arr = lambda v: (ctypes.c_uint16 * len(v))(*[bf(a) for a in v])
cx, c1, c3, c2 = arr(x), arr(w1), arr(w3), arr(w2)
def packed(ws, n, k):
    buf = ctypes.create_string_buffer(L.fk_packed_bytes(n, k, len(ws)) + 64)
    p = (ctypes.addressof(buf) + 63) // 64 * 64
    assert L.fk_pack((ctypes.c_void_p * len(ws))(*[ctypes.addressof(w) for w in ws]), len(ws), n, k, p, 0) == 0
    return buf, p
b13, p13 = packed([c1, c3], F, H)
b2, p2 = packed([c2], H, F)
y = (ctypes.c_uint16 * (T * H))()
assert L.fk_expert_ffn(p13, p2, H, F, ctypes.addressof(cx), T, ctypes.addressof(y), 0) == 0
for t in range(T):
    a = [sum(w1[i * H + j] * x[t * H + j] for j in range(H)) for i in range(F)]
    u = [sum(w3[i * H + j] * x[t * H + j] for j in range(H)) for i in range(F)]
    h = [ai / (1 + math.exp(-ai)) * ui for ai, ui in zip(a, u)]
    for d in range(H):
        ref = sum(w2[d * F + i] * h[i] for i in range(F))
        mag = sum(abs(w2[d * F + i] * h[i]) for i in range(F))
        assert abs(f(y[t * H + d]) - ref) <= 2 ** -8 * (mag + abs(ref)) + 1e-6, (t, d)
print("ISA", ["generic", "avx2", "avx512", "avx512_bf16"][L.fk_isa()])
"""


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (apt-get install qemu-user)")
def test_runs_on_haswell_without_avx512():
    # qemu's TCG has no AVX-512, so any AVX-512 (or AMX) instruction reached here would be SIGILL
    r = run_python(_SMALL_CALL, prefix=("qemu-x86_64", "-cpu", "Haswell"), auto_isa=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ISA avx2" in r.stdout


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (apt-get install qemu-user)")
def test_library_runs_on_baseline_x86_64():
    # qemu64: SSE2-era x86-64 (torch itself needs more, so only the library is loaded)
    r = run_python(_CTYPES_CALL % str(Path(fk.__file__).with_name("_lib.py")), prefix=("qemu-x86_64", "-cpu", "qemu64"),
                   auto_isa=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ISA generic" in r.stdout


@pytest.mark.parametrize("tokens", [1, 32])
def test_benchmark_packed_expert(benchmark, tokens):
    """Regression tracking with pytest-benchmark (--benchmark-enable); a plain correctness run otherwise."""
    x, w1, w3, w2 = expert_case(1024, 3584, tokens, seed=11)
    pe = fk.PackedExpert(w1, w3, w2)
    y = benchmark(pe.forward, x)
    check_expert(y, x, w1, w3, w2)


def test_amx_crossover_is_where_amx_wins_from_there_on():
    # {tokens: (amx s, vector s)}: a noisy win below the crossover does not count
    assert fk.amx_crossover({2: (2.7, 2.2), 4: (2.7, 2.6), 6: (2.7, 2.6), 8: (2.7, 3.1), 16: (2.7, 6.0)}) == 8
    assert fk.amx_crossover({2: (2.0, 2.2), 4: (2.7, 2.6), 8: (2.6, 3.1), 16: (2.6, 6.0)}) == 8
    assert fk.amx_crossover({2: (2.0, 2.2), 16: (2.6, 6.0)}) == 2
    assert fk.amx_crossover({2: (2.7, 2.2), 16: (6.1, 6.0)}) == 17  # AMX never wins: not used below 17


class _ScriptedClock:
    """perf_counter for fiddler.kernels.timing: each timed call (a start and an end reading) lasts the next
    of `durations` seconds, whatever the kernel really took."""

    def __init__(self, durations):
        self.durations, self.now, self.calls = list(durations), 0.0, 0

    def perf_counter(self):
        self.calls += 1
        if self.calls % 2 == 0:
            self.now += self.durations.pop(0)
        return self.now


@pytest.mark.skipif(not FEATS.get("amx_supported"), reason="no AMX-BF16 on this CPU")
def test_amx_tuning_measures_sets_and_can_be_overridden(monkeypatch):
    import types

    fk.set_isa("auto")
    try:
        e = fk.PackedExpert(*(torch.ones(64, 32, dtype=torch.bfloat16),) * 2, torch.ones(32, 64, dtype=torch.bfloat16))
        # a few KB cannot show the DRAM regime: nothing is measured, the default stays
        assert fk.tune_amx([e]) == {"min_tokens": 4, "source": "default"}
        monkeypatch.setattr(fk.probe, "llc_bytes", lambda: 0)
        # injected times (AMX, vector per candidate): AMX loses at 2 tokens and wins from 16
        clock = _ScriptedClock([3e-3, 2e-3, 4e-3, 9e-3])
        monkeypatch.setattr(fk.timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
        got = fk.tune_amx([e] * 4, candidates=(2, 16), rounds=1)
        assert got["source"].startswith("tune_amx: measured on 4 experts") and got["ms"] == {2: (3.0, 2.0), 16: (4.0, 9.0)}
        assert got["min_tokens"] == 16 == fk.features()["amx_min_tokens"]
        monkeypatch.setenv("FIDDLER_KERNEL_AMX_MIN_TOKENS", "5")
        assert fk.tune_amx([e]) == {"min_tokens": 5, "source": "FIDDLER_KERNEL_AMX_MIN_TOKENS"}
    finally:
        fk.set_isa("auto")
    assert fk.amx_choice() == {"min_tokens": 4, "source": "default"}


@pytest.mark.skipif(not FEATS.get("amx_supported"), reason="no AMX-BF16 on this CPU")
def test_amx_tuning_stores_the_times_it_chose_from(monkeypatch):
    """CI read min_tokens 17 beside ms {2: (0.028, 0.01), 16: (0.009, 0.009)}, from which the rule
    gives 16: the times differed below the stored precision. Timings are injected (no kernel timing)."""
    import types

    fk.set_isa("auto")
    try:
        e = fk.PackedExpert(*(torch.ones(64, 32, dtype=torch.bfloat16),) * 2, torch.ones(32, 64, dtype=torch.bfloat16))
        monkeypatch.setattr(fk.probe, "llc_bytes", lambda: 0)
        # per candidate (2, 16): AMX then vector; at 16 AMX is 0.3 us slower, below the stored microsecond
        clock = _ScriptedClock([28.0004e-3, 10.0e-3, 9.0004e-3, 9.0001e-3])
        monkeypatch.setattr(fk.timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
        got = fk.tune_amx([e] * 4, candidates=(2, 16), rounds=1)
        assert not clock.durations  # every injected time was used
        assert got["min_tokens"] == fk.amx_crossover(got["ms"]) == fk.features()["amx_min_tokens"]
    finally:
        fk.set_isa("auto")


def test_amx_tuning_is_a_no_op_without_amx():
    fk.set_isa("avx2" if FEATS.get("avx2") else "generic")
    try:
        assert fk.tune_amx([]) == {"min_tokens": None, "source": "AMX not in use"}
    finally:
        fk.set_isa("auto")


@pytest.mark.skipif(FEATS.get("best_isa") not in ("avx512", "avx512_bf16"), reason="no AVX-512 F/BW/VL/DQ")
@pytest.mark.parametrize("hidden,ffn", [(4200, 300), (96, 2080), (33, 17)])
def test_avx512_path_computes_the_avx2_paths_bits(hidden, ffn):
    """The AVX-512 F path widens bf16 to fp32 as the AVX2 path does and sums each output in its order (per row:
    the even column's product, then the odd one's, kp by kp), 12 tokens a call instead of 2 and K in slices of 128
    column pairs: the same bits at every token count (partial calls of 1-11 tokens, the many-token blocking) and K
    (4200: two K chunks and a partial slice)."""
    x, w1, w3, w2 = expert_case(hidden, ffn, 37, seed=5)
    pe, lin = fk.PackedExpert(w1, w3, w2), fk.PackedLinear(w1)
    out = {}
    for path in ("avx2", "avx512"):
        fk.set_isa(path)
        out[path] = [(pe(x[:t].clone()), lin.forward(x[:t].clone()), lin.forward(x[:t].clone(), out_dtype=torch.float32))
                     for t in (1, 2, 3, 7, 8, 9, 12, 13, 16, 17, 37)]
    for (a, b) in zip(out["avx2"], out["avx512"]):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), a[0].shape
