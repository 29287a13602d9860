"""fiddler.kernels.roofline: the compute peak's choice of source and the roofline time (times injected:
no assertion here depends on how fast this machine is)."""
from __future__ import annotations

import pytest

import fiddler.kernels as fk
from fiddler.kernels import roofline as rl


def test_roofline_is_the_larger_of_the_memory_and_the_compute_time():
    assert rl.roofline_s(352e6, 1e9, gbps=32.0, gflops=2000.0) == pytest.approx(352e6 / 32e9)  # memory-bound
    assert rl.roofline_s(352e6, 90e9, gbps=32.0, gflops=2000.0) == pytest.approx(90e9 / 2000e9)  # compute-bound
    with pytest.raises(ValueError, match="positive"):
        rl.roofline_s(1, 1, gbps=0.0, gflops=1.0)
    assert rl.expert_flops(4096, 14336, 64) == 2 * 3 * 4096 * 14336 * 64


@pytest.mark.parametrize("kind", ["bf16", "q8_0", "q4_0"])
def test_compute_peak_takes_the_faster_source_and_names_it(monkeypatch, kind):
    if not fk.is_available():
        pytest.skip(fk.load_error())
    flops = 2 * 512 * 4096 * 4096
    seconds = iter([flops / 900e9, flops / 1400e9])  # torch first, then the kernel
    monkeypatch.setattr(rl, "_best_s", lambda fn, repeats: next(seconds))
    peak = rl.compute_peak(kind, threads=2, cached=False)
    assert peak["kind"] == kind and peak["threads"] == 2 and peak["shape"] == [512, 4096, 4096]
    torch_name = [n for n in peak["sources"] if n.startswith("torch_")]
    kernel_name = [n for n in peak["sources"] if n.startswith("kernel_")]
    assert len(kernel_name) == 1 and kernel_name[0].endswith("_2t")
    assert peak["sources"][kernel_name[0]] == pytest.approx(1400.0)
    assert peak["best"] == kernel_name[0] and peak["gflops"] == pytest.approx(1400.0)
    if torch_name:  # a torch without a CPU int8 GEMM leaves the kernel alone
        assert peak["sources"][torch_name[0]] == pytest.approx(900.0)
    seconds = iter([flops / 1600e9, flops / 1400e9])
    peak = rl.compute_peak(kind, threads=2, cached=False)
    if torch_name:
        assert peak["best"] == torch_name[0] and peak["gflops"] == pytest.approx(1600.0)


def test_compute_peak_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="kind"):
        rl.compute_peak("fp8")
    with pytest.raises(ValueError, match="repeats"):
        rl.compute_peak("bf16", repeats=0)


def test_compute_peak_is_cached_per_argument_set(monkeypatch):
    if not fk.is_available():
        pytest.skip(fk.load_error())
    calls = []
    monkeypatch.setattr(rl, "_best_s", lambda fn, repeats: calls.append(1) or 0.01)
    monkeypatch.setattr(rl, "_CACHE", {})
    a = rl.compute_peak("bf16", threads=1, repeats=1)
    n = len(calls)
    b = rl.compute_peak("bf16", threads=1, repeats=1)
    assert a == b and len(calls) == n  # measured once
    b["gflops"] = -1.0
    assert rl.compute_peak("bf16", threads=1, repeats=1)["gflops"] == a["gflops"]  # a copy, not the cache


def test_isa_kind_names_the_instruction_of_each_recorded_path():
    assert rl.isa_kind("avx512_bf16") == "avx512_bf16"
    assert rl.isa_kind("avx512_bf16+amx") == "amx_bf16"
    assert rl.isa_kind("avx512_vnni:a8") == "avx512_vnni"
    assert rl.isa_kind("avx512_vnni+amx:a8") == "amx_int8"
    assert rl.isa_kind("avx2") == "avx2_fma"
    assert rl.isa_kind("avx512") == "avx512_fma"
    for none in ("avx2:a8", "generic", "generic:w", "avx512_vnni:w"):  # no probe of their products
        assert rl.isa_kind(none) is None, none


def test_isa_peak_runs_what_this_cpu_has_and_refuses_the_rest():
    import fiddler.kernels as fk

    if not fk.is_available():
        pytest.skip(f"kernel library not available: {fk.load_error()}")
    with pytest.raises(ValueError, match="one of"):
        rl.isa_peak("sse2")
    with pytest.raises(ValueError):
        rl.isa_peak("avx2_fma", ops=0)
    f = fk.features()
    avx512 = all(f[x] for x in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "os_avx512"))
    has = {"avx512_bf16": avx512 and f["avx512_bf16"], "avx512_vnni": f["avx512f"] and f["avx512_vnni"] and f["os_avx512"],
           "avx512_fma": avx512, "avx2_fma": f["avx2"] and f["fma"] and f["os_avx"], "amx_bf16": f["amx_supported"],
           "amx_int8": f["amx_supported"] and f["amx_int8"]}
    for kind in rl.ISA_PEAK_KINDS:
        if has[kind]:
            v = rl.isa_peak(kind, threads=1, repeats=1, ops=1e6)  # it ran: a positive, finite rate
            assert 0 < v < float("inf"), kind
        else:
            with pytest.raises(RuntimeError, match="cannot run"):
                rl.isa_peak(kind, threads=1, repeats=1, ops=1e6)
