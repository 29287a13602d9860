"""fiddler.kernels.quant: llama.cpp-compatible Q8_0/Q4_0 blocks (quantizer and block bytes checked
against the gguf package's reference implementation), and every compiled quantized path in both modes
against an fp64 reference computed from the dequantized weights: odd sizes, 1..257 tokens, the
AVX2-only path under an emulated Haswell."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fiddler.kernels as fk

pytestmark = pytest.mark.skipif(not fk.is_available(), reason=f"kernel library not built: {fk.load_error()}")
if fk.is_available():
    from fiddler.kernels import quant as fq

FEATS = fk.features() if fk.is_available() else {}
QISAS = [
    pytest.param("avx512_vnni", marks=pytest.mark.skipif(
        not (FEATS.get("avx512_vnni") and FEATS.get("avx512bw") and FEATS.get("os_avx512")), reason="no AVX512-VNNI")),
    pytest.param("avx512_vnni+amx", marks=pytest.mark.skipif(
        not (FEATS.get("amx_int8") and FEATS.get("amx_tile") and FEATS.get("os_amx") and FEATS.get("avx512_vnni")),
        reason="no AMX-INT8")),
    # the tile kernel's logic (tiling, strides, the Q4_0 unpack, the pipelined units) on software tiles
    pytest.param("avx512_vnni+amx_emulated", marks=pytest.mark.skipif(
        not (FEATS.get("avx512_vnni") and FEATS.get("avx512bw") and FEATS.get("os_avx512")), reason="no AVX512-VNNI")),
    pytest.param("avx2", marks=pytest.mark.skipif(not (FEATS.get("avx2") and FEATS.get("f16c")), reason="no AVX2+F16C")),
    "generic",
]
FORMATS = ["q8_0", "q4_0"]
MODES = ["a8", "w"]


@pytest.fixture(autouse=True)
def _restore_mode():
    yield
    fq.set_mode("auto")
    fq.set_amx("auto")
    fq.set_pass_tokens()


def use(mode: str, isa: str) -> None:
    """Selects a path of QISAS: "avx512_vnni+amx" / "+amx_emulated" put every token count through the
    tiles (a8; w mode has no tile kernel and runs the vector one)."""
    base, _, tiles = isa.partition("+")
    fq.set_mode(mode, base)
    fq.set_amx({"amx": "on", "amx_emulated": "emulated"}.get(tiles, "off"), min_tokens=1)


def acts_q8_0(x: torch.Tensor) -> torch.Tensor:
    """The activations the a8 mode computes with, as fp64: Q8_0 per 32-block as llama.cpp's x86
    quantize_row_q8_0 (d = amax / 127 rounded to fp16, q = round-half-even(x * 127 / amax))."""
    T, k = x.shape
    kp = (k + 63) // 64 * 64
    v = torch.zeros(T, kp, dtype=torch.float32)
    v[:, :k] = x.float()
    b = v.view(T, -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    # 127 / amax correctly rounded to fp32 (torch's fp32 division of a scalar by a tensor is not always)
    idv = torch.where(amax > 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))
    q = torch.round(b * idv)
    d = (amax / 127.0).half().double()
    return (q.double() * d).view(T, kp)[:, :k]


def odd_linear_and_expert(fmt: str, seed: int):
    """A linear (odd K: padded blocks) and an expert of odd sizes on random rows: run(counts) -> their fp32 / bf16
    outputs for the first t rows, t in counts, on the path selected when it is called."""
    g = torch.Generator().manual_seed(seed)
    lin = fq.QuantLinear.from_float(torch.randn(37, 200, generator=g) / 200**0.5, fmt)
    e = fq.QuantExpert.from_float(torch.randn(72, 40, generator=g) / 40**0.5, torch.randn(72, 40, generator=g) / 40**0.5,
                                  torch.randn(40, 72, generator=g) / 72**0.5, fmt)
    x = torch.randn(35, 200, generator=g).to(torch.bfloat16)
    xe = torch.randn(35, 40, generator=g).to(torch.bfloat16)
    return lambda counts: [(lin(x[:t], out_dtype=torch.float32), e(xe[:t])) for t in counts]


def ref_linear(blocks, fmt, k, x, mode):
    w = fq.dequantize(blocks, fmt, k, torch.float64)
    xr = acts_q8_0(x) if mode == "a8" else x.double()
    return xr @ w.T


def ref_expert(e: "fq.QuantExpert", x, mode):
    w1, w3, w2 = e.dequantized(torch.float64)
    xr = acts_q8_0(x) if mode == "a8" else x.double()
    h = (F.silu(xr @ w1.T) * (xr @ w3.T)).float()  # the quantized path keeps h in fp32, as llama.cpp does
    hr = acts_q8_0(h) if mode == "a8" else h.double()
    return hr @ w2.T


def rel(y, r):
    return ((y.double() - r).norm() / r.norm()).item()


# ------------------------------------------------------------------ blocks: bit-compatible with llama.cpp
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizer_matches_gguf_reference(fmt):
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(37, 96, generator=g) * 0.02
    w[0, :32] = 0.0  # an all-zero block: d = 0
    w[1, 5] = 3.0  # one outlier dominating its block
    ours = fq.quantize(w, fmt).numpy()
    qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[fmt]
    theirs = gguf.quants.quantize(w.numpy().astype(np.float32), qt)
    assert np.array_equal(ours, theirs.reshape(ours.shape))
    deq = gguf.quants.dequantize(theirs, qt).reshape(37, 96)
    assert np.array_equal(fq.dequantize(torch.from_numpy(ours), fmt).numpy(), deq)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_round_trips_block_bytes(fmt):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(45, 160, generator=g)
    blocks = fq.quantize(w, fmt)
    assert torch.equal(fq.QuantLinear(blocks, fmt, 45, 160).blocks(), blocks)
    e = fq.QuantExpert.from_float(torch.randn(40, 96, generator=g), torch.randn(40, 96, generator=g),
                                  torch.randn(96, 40, generator=g), fmt)
    w1, w3, w2 = e.blocks()
    assert w1.shape == (40, fq.row_bytes(fmt, 96)) and w2.shape == (96, fq.row_bytes(fmt, 40))
    e2 = fq.QuantExpert(w1, w3, w2, fmt, 96, 40)
    assert all(torch.equal(a, b) for a, b in zip(e.packed(), e2.packed()))
    assert e.nbytes == e.packed()[0].numel() + e.packed()[1].numel()


def test_packed_bytes_are_the_block_bytes_plus_padding():
    # Mixtral-like shape, no padding: exactly the GGUF bytes (34 / 18 per 32 weights)
    for fmt, per in (("q8_0", 34), ("q4_0", 18)):
        lin = fq.QuantLinear.from_float(torch.randn(64, 256), fmt)
        assert lin.nbytes == 64 * 256 // 32 * per


# ------------------------------------------------------------------ numerics of every path and mode
@pytest.mark.parametrize("isa", QISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,tokens", [(33, 70, 1), (16, 64, 2), (100, 257, 9), (47, 1000, 17), (19, 96, 257)])
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])  # fp32: quantized from fp32, as llama.cpp
def test_linear_against_fp64(isa, mode, fmt, n, k, tokens, xdt):
    use(mode, isa)
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    lin = fq.QuantLinear.from_float(w, fmt)
    x = torch.randn(tokens, k, generator=g).to(xdt)
    y = lin(x, out_dtype=torch.float32)
    r = ref_linear(lin.blocks(), fmt, k, x, mode)
    # fp32 sums of exact products (a8: integer dot products) against fp64: far below bf16's 2^-8
    assert rel(y, r) < 1e-5, rel(y, r)
    yb = lin(x, out_dtype=torch.bfloat16)  # bf16 output: one rounding of the fp32 result
    assert torch.equal(yb, y.to(torch.bfloat16))


@pytest.mark.parametrize("isa", QISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_has_the_same_bits_alone_or_in_any_token_group(isa, fmt):
    """The a8 micro-kernels take up to the path's mr tokens a call (16 on AVX-512, the fp32 sums of
    tokens past 8 in memory rather than registers): a row's result is the same bits alone as among 37
    (token groups of every size, a short last one), which batched requests rely on."""
    use("a8", isa)
    g = torch.Generator().manual_seed(7)
    lin = fq.QuantLinear.from_float(torch.randn(48, 320, generator=g) / 320**0.5, fmt)
    x = torch.randn(37, 320, generator=g).to(torch.bfloat16)
    together = lin(x, out_dtype=torch.float32)
    for n in (1, 8, 9, 16, 17):
        part = lin(x[:n], out_dtype=torch.float32)
        assert torch.equal(part, together[:n]), n
    alone = torch.cat([lin(x[i:i + 1], out_dtype=torch.float32) for i in range(37)])
    assert torch.equal(alone, together)


@pytest.mark.parametrize("tiles", [p for p in QISAS if "+amx" in str(getattr(p, "values", [p])[0])])
@pytest.mark.parametrize("fmt", FORMATS)
def test_tiles_give_the_vector_paths_bits(tiles, fmt):
    """The AMX-INT8 kernel's int32 sums are exact and its fp32 steps are the AVX-512 kernel's in the same
    order: linears and experts give the same bits on both paths at every token count (odd K, padded rows,
    token groups of 16 with a short last one), so the crossover between them is a speed choice only."""
    run = odd_linear_and_expert(fmt, seed=11)
    outs = {}
    for isa in ("avx512_vnni", tiles):
        use("a8", isa)
        outs[isa] = run((1, 3, 4, 15, 16, 17, 35))
    for (ly, ey), (lt, et) in zip(outs["avx512_vnni"], outs[tiles]):
        assert torch.equal(ly, lt) and torch.equal(ey, et)


@pytest.mark.skipif(not (FEATS.get("avx512_vnni") and FEATS.get("avx512bw") and FEATS.get("os_avx512")),
                    reason="no AVX512-VNNI")
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_pass_or_two_give_the_same_bits(fmt):
    """The AVX-512 VNNI kernel takes 9-16 tokens a call in one pass or in two (set_pass_tokens: the per-CPU
    speed choice); the int32 sums are exact and every token's fp32 steps are the same, so linears and experts
    give the same bits either way at every token count."""
    run = odd_linear_and_expert(fmt, seed=13)
    use("a8", "avx512_vnni")
    outs = {}
    for tokens in (8, 16):
        assert fq.set_pass_tokens(tokens) == {"tokens": tokens, "source": "set_pass_tokens"}
        outs[tokens] = run((1, 8, 9, 12, 15, 16, 17, 35))
    for (l8, e8), (l16, e16) in zip(outs[8], outs[16]):
        assert torch.equal(l8, l16) and torch.equal(e8, e16)


def test_pass_tokens_are_reported_and_validated():
    default = fq.set_pass_tokens()
    assert default["tokens"] in (8, 16) and default["source"].startswith("table: ")
    for bad in (0, 4, 12, 32, True, 8.0):
        with pytest.raises(ValueError, match="8 or 16"):
            fq.set_pass_tokens(bad)
    assert fq.pass_tokens() == default  # a refused setting changes nothing
    assert fq.set_pass_tokens(8, source="a test")["source"] == "a test"
    env = {**os.environ, "FIDDLER_KERNEL_QPASS": "8" if default["tokens"] == 16 else "16"}
    out = subprocess.run([sys.executable, "-c", "from fiddler.kernels import quant; print(quant.pass_tokens())"],
                         env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"'tokens': {env['FIDDLER_KERNEL_QPASS']}, 'source': 'FIDDLER_KERNEL_QPASS'" in out
    bad = subprocess.run([sys.executable, "-c", "from fiddler.kernels import quant"], capture_output=True, text=True,
                         env={**os.environ, "FIDDLER_KERNEL_QPASS": "junk"}, timeout=120)
    assert bad.returncode != 0 and "FIDDLER_KERNEL_QPASS must be auto, 8 or 16, got 'junk'" in bad.stderr


def test_amx_modes_are_reported_and_validated():
    with pytest.raises(ValueError, match="unknown AMX mode"):
        fq.set_amx("maybe")
    for bad in (0, 18, 2.5, {"q5_k": 4}):
        with pytest.raises(ValueError, match="min_tokens"):
            fq.set_amx("auto", min_tokens=bad)
    a = fq.set_amx("auto")
    assert a["amx"] in ("on", "off") and all(1 <= n <= fq.AMX_NEVER for n in a["min_tokens"].values())
    assert (a["amx"] == "on") == (a["status"] == "ok" and fq.mode()["isa"] == "avx512_vnni")
    if not FEATS.get("amx_int8"):
        with pytest.raises(ValueError, match="AMX-INT8"):
            fq.set_amx("on")
    fq.set_mode("w")  # the tiles serve a8 only: in w mode they are off whatever was asked
    assert fq.amx()["amx"] == "off" and fq.path(16, "q4_0").endswith(":w") and "+amx" not in fq.path(16, "q4_0")
    if FEATS.get("avx512_vnni") and FEATS.get("os_avx512"):
        fq.set_mode("a8", "avx512_vnni")
        a = fq.set_amx("emulated", min_tokens={"q8_0": fq.AMX_NEVER, "q4_0": 5})
        assert a["amx"] == "emulated" and a["min_tokens"] == {"q8_0": fq.AMX_NEVER, "q4_0": 5}
        assert fq.path(4, "q4_0") == "avx512_vnni:a8" and fq.path(5, "q4_0") == "avx512_vnni+amx_emulated:a8"
        assert fq.path(300, "q4_0") == "avx512_vnni+amx_emulated:a8" and fq.path(300, "q8_0") == "avx512_vnni:a8"


@pytest.mark.skipif(not (FEATS.get("avx512_vnni") and FEATS.get("os_avx512")), reason="no AVX512-VNNI")
def test_tune_amx_sets_the_crossover_of_injected_timings(monkeypatch):
    """tune_amx times each candidate with the tiles and without, interleaved, and sets the format's
    min_tokens by fiddler.kernels.amx_crossover (one tune_amx for every format); the clock is injected (no assertion rests on a real
    timing): here the tiles lose at 4 and 8 and win from 12."""
    import fiddler.kernels as fkm

    fq.set_mode("a8", "avx512_vnni")
    fq.set_amx("emulated")
    g = torch.Generator().manual_seed(3)
    experts = [fq.QuantExpert.from_float(torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g),
                                         torch.randn(32, 64, generator=g), "q4_0") for _ in range(2)]
    monkeypatch.setattr(fkm.probe, "llc_bytes", lambda: 1)  # these few bytes stand for experts streamed from DRAM
    ms = {4: (3.0, 2.0), 8: (3.0, 2.5), 12: (2.0, 3.0), 16: (2.0, 4.0)}  # (tiles, vector) per call
    ticks = iter([x for _ in range(2) for c in ms for d in ms[c] for x in (0.0, d / 1e3)])
    monkeypatch.setattr(fkm.timing, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    got = fq.tune_amx(experts, candidates=tuple(ms), rounds=2)
    assert got["min_tokens"] == {"q8_0": 16, "q4_0": 12} and got["amx"] == "emulated"
    assert got["ms"] == {"q4_0": ms} and got["source"].startswith("tune_amx: measured on 2 q4_0 experts")
    # too few bytes to stream: nothing measured, nothing changed
    monkeypatch.setattr(fkm.probe, "llc_bytes", lambda: 1 << 40)
    assert fq.tune_amx(experts)["min_tokens"] == {"q8_0": 16, "q4_0": 12}


@pytest.mark.parametrize("isa", QISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("hidden,ffn,tokens", [(40, 72, 1), (96, 160, 5), (64, 130, 33)])
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])
def test_expert_and_moe_against_fp64(isa, mode, fmt, hidden, ffn, tokens, xdt):
    use(mode, isa)
    g = torch.Generator().manual_seed(hidden + ffn)
    experts = [fq.QuantExpert.from_float(torch.randn(ffn, hidden, generator=g) / hidden**0.5,
                                         torch.randn(ffn, hidden, generator=g) / hidden**0.5,
                                         torch.randn(hidden, ffn, generator=g) / ffn**0.5, fmt) for _ in range(3)]
    x = torch.randn(tokens, hidden, generator=g).to(xdt)
    refs = [ref_expert(e, x, mode) for e in experts]
    ys = [e(x) for e in experts]
    for y, r in zip(ys, refs):
        # the bf16 output's rounding (2^-9 relative per element); a8: a last-bit difference of h can move
        # one activation block's scale
        assert rel(y, r) < 3e-3, rel(y, r)
    wts = torch.tensor([0.5, 0.3, 0.2]).to(torch.bfloat16)
    out = fq.moe_ffn(experts, wts, x)
    # the same roundings as the executor's torch combine of the per-expert outputs
    comb = sum((y * w).float() for y, w in zip(ys, wts)).to(torch.bfloat16)
    assert torch.equal(out, comb)


def test_modes_and_paths_are_reported_and_validated():
    m = fq.set_mode("auto")
    assert m["mode"] in ("a8", "w") and m["source"] == "default"
    assert fq.set_mode("w", "generic") == {"mode": "w", "isa": "generic", "source": "set"}
    with pytest.raises(ValueError, match="unknown quantized mode"):
        fq.set_mode("int4")
    with pytest.raises(ValueError, match="unknown quant format"):
        fq.quantize(torch.randn(4, 32), "q5_k")
    lin = fq.QuantLinear.from_float(torch.randn(8, 64), "q8_0")
    with pytest.raises(ValueError):
        lin(torch.randn(2, 63).to(torch.bfloat16))
    with pytest.raises(TypeError):
        lin(torch.randn(2, 64).half())
    with pytest.raises(ValueError):  # fp32 activations: contiguous 2-D rows too
        lin(torch.randn(64, 2).t())


_HASWELL = """
import torch
from fiddler.kernels import quant as fq
torch.manual_seed(0)
for fmt in ("q8_0", "q4_0"):
    for mode in ("a8", "w"):
        fq.set_mode(mode)
        w = torch.randn(40, 96) / 10
        lin = fq.QuantLinear.from_float(w, fmt)
        x = torch.randn(3, 96).to(torch.bfloat16)
        y = lin(x, out_dtype=torch.float32).double()
        r = x.double() @ fq.dequantize(lin.blocks(), fmt, 96, torch.float64).T
        assert ((y - r).norm() / r.norm()).item() < (2e-2 if mode == "a8" else 1e-5)
print("QISA", fq.mode()["isa"])
"""


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (apt-get install qemu-user)")
def test_quantized_path_runs_on_haswell_without_avx512():
    # qemu's TCG has no AVX-512: an AVX-512/VNNI instruction reached here would be SIGILL
    r = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", sys.executable, "-c", _HASWELL], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "QISA avx2" in r.stdout


_PATHS = """
import json
import fiddler.kernels as fk
print("PATHS", json.dumps({"vector": fk.isa(), "quant": fk.quant.mode()["isa"], "features": fk.features()}))
"""


def _paths(**env) -> dict:
    r = subprocess.run([sys.executable, "-c", _PATHS], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.split("PATHS", 1)[1])


def test_the_quantized_path_is_the_cpus_best_unless_the_vector_path_was_set_below_it():
    """The quantized kernel needs VNNI, not BF16: a CPU with AVX512-VNNI and no AVX512-BF16 (Cascade and Ice Lake,
    a VM hiding BF16) ran its bf16 experts on AVX2 and, capped by that, its quantized ones on AVX2 too (0.17-0.19
    of the quantized roofline at 16 tokens on such an Intel Xeon). A vector path set below the CPU's best still
    takes the quantized one down with it (FIDDLER_KERNEL_ISA as a proxy for another CPU class)."""
    auto = _paths(FIDDLER_KERNEL_ISA=None)
    f = auto["features"]
    best = ("avx512_vnni" if all(f[k] for k in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "os_avx512", "f16c"))
            else "avx2" if all(f[k] for k in ("avx2", "fma", "os_avx", "f16c")) else "generic")
    assert auto["vector"] == f["best_isa"]
    assert auto["quant"] == best
    forced = _paths(FIDDLER_KERNEL_ISA="generic")  # below every x86 CPU's best
    assert forced["vector"] == "generic"
    assert forced["quant"] == ("generic" if f["best_isa"] != "generic" else best)
