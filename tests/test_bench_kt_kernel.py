"""scripts/bench_kt_kernel.py: kTransformers' kernel beside ours. kt-kernel lives in its own virtual
environment (see the script), so here only what runs without it: the refusal, with the reason, where it
does not import or cannot run a format, and the comparison's arithmetic."""
from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_kt_kernel.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_kt_kernel", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernels():
    import fiddler.kernels as fk

    if not fk.is_available():
        pytest.skip(f"kernel library not available: {fk.load_error()}")
    return fk


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_without_kt_kernel_it_says_why_and_measures_nothing(fmt):
    if importlib.util.find_spec("kt_kernel") is not None:
        pytest.skip("kt-kernel is importable here")
    kernels()
    r = subprocess.run([sys.executable, str(SCRIPT), "--format", fmt, "--hidden", "64", "--ffn", "128", "--copies", "2",
                        "--tokens", "1", "--rounds", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "kt-kernel does not import here: ModuleNotFoundError" in r.stderr
    assert "tokens" not in r.stdout  # no row was measured


def test_a_format_kt_cannot_run_is_skipped_with_its_reason(tmp_path, monkeypatch, capsys):
    kernels()
    mod = load()
    monkeypatch.setitem(sys.modules, "kt_kernel", types.SimpleNamespace(__cpu_variant__="avx2", __version__="0.7.2"))
    build = types.SimpleNamespace(AVX2BF16_MOE=object(), AMXInt8_MOE=object())  # kt_kernel_ext.moe of a build
    monkeypatch.setitem(sys.modules, "kt_kernel_ext", types.SimpleNamespace(moe=build))
    monkeypatch.setitem(sys.modules, "kt_kernel_ext.moe", build)
    probed = []

    def probe(fmt, threads):
        probed.append(fmt)
        return "died of SIGILL running a tiny expert: no message"

    monkeypatch.setattr(mod, "probe_kt", probe)
    out = tmp_path / "r.json"
    assert mod.main(["--format", "int8", "--threads", "1", "--json", str(out)]) == 3  # present, but dies in the child
    err = capsys.readouterr()
    assert "skipped: kt-kernel 0.7.2 (avx2 build) cannot run int8 here: died of SIGILL" in err.err
    assert "tokens" not in err.out
    saved = json.loads(out.read_text())
    assert saved["rows"] == [] and "died of SIGILL" in saved["skipped"] and saved["kt_class"] == "AMXInt8_MOE"
    assert saved["fiddler_kernel"] == "QuantExpert q8_0"
    assert mod.main(["--format", "int4", "--threads", "1"]) == 3  # absent: said without a child
    assert "cannot run int4 here: its avx2 build has no AMXInt4_MOE" in capsys.readouterr().err
    assert probed == ["int8"]


def test_the_operator_is_the_first_the_build_has_and_a_build_without_one_names_them():
    mod = load()
    avx512 = types.SimpleNamespace(AMXBF16_MOE=object(), AVX2BF16_MOE=object(), AMXInt8_MOE=None)  # None: not compiled
    avx2 = types.SimpleNamespace(AVX2BF16_MOE=object())  # kt-kernel 0.7.2's avx2 build: no AMX* classes
    assert mod.kt_operator(avx512, "bf16") == "AMXBF16_MOE" and mod.kt_operator(avx2, "bf16") == "AVX2BF16_MOE"
    assert mod.missing_operator(avx512, "bf16", "avx512_bf16") is None
    assert mod.kt_operator(avx512, "int8") is None
    assert mod.missing_operator(avx512, "int8", "avx512_bf16") == "its avx512_bf16 build has no AMXInt8_MOE"
    assert mod.missing_operator(avx2, "int4", "avx2") == "its avx2 build has no AMXInt4_MOE"
    none = types.SimpleNamespace()
    assert mod.missing_operator(none, "bf16", "x") == "its x build has no AMXBF16_MOE or AVX2BF16_MOE"


def test_the_probe_says_how_the_child_failed():
    mod = load()
    assert mod.probe_failure(0, "anything") is None
    assert mod.probe_failure(-int(signal.SIGILL), "").startswith("died of SIGILL running a tiny expert: no message")
    why = mod.probe_failure(1, "Traceback ...\nRuntimeError: max_m and k must be multiple of M_STEP\n")
    assert why == "failed (exit 1) running a tiny expert: RuntimeError: max_m and k must be multiple of M_STEP"


def test_kt_bytes_are_one_experts_files(tmp_path):
    mod = load()
    d = tmp_path / "_layer_0" / "_numa_0"
    d.mkdir(parents=True)
    sizes = {"INT8_gate_0_300Byte_quant_.kt": 300, "INT8_gate_0_8Byte_scale_.kt": 8, "INT8_up_0_300Byte_quant_.kt": 300,
             "INT8_down_0_310Byte_quant_.kt": 310, "INT8_gate_1_300Byte_quant_.kt": 300,
             "INT8_up_10_777Byte_quant_.kt": 777}  # expert 10 is not expert 1
    for name, size in sizes.items():
        (d / name).write_bytes(b"\0" * size)
    assert mod.kt_expert_bytes(str(tmp_path)) == 300 + 8 + 300 + 310
    assert mod.kt_expert_bytes(str(tmp_path), expert=1) == 300
    assert mod.kt_expert_bytes(str(tmp_path), expert=2) == 0


def test_errors_above_the_formats_bound_are_named():
    mod = load()
    assert mod.error_problems({"fiddler": 0.01, "kt": 0.02}, 0.05) == []
    assert mod.error_problems({"fiddler": 0.01, "kt": 0.9}, 0.6) == ["kt 0.9 > 0.6"]
    assert mod.error_problems({"fiddler": float("nan"), "kt": 0.0}, 0.6) == ["fiddler nan > 0.6"]


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "q8_0", "q4_0"])
def test_fiddlers_side_is_within_the_formats_bound_and_a_misread_layout_is_not(fmt):
    """The bound must pass each format's own rounding and catch a side that computes the wrong expert."""
    kernels()
    mod = load()
    w1, w3, w2 = mod.random_experts(2, 256, 512)
    ours = mod.fiddler_experts(fmt, w1, w3, w2)
    assert type(ours[0]).__name__ == ("PackedExpert" if fmt == "bf16" else "QuantExpert")
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = mod.torch_expert(mod.ExpertWeights(w1[0], w3[0], w2[0]), x)
    bound = mod.FORMATS[fmt].max_err
    assert mod.rel_err(ours[0].forward(x, threads=1), ref) < bound
    assert mod.rel_err(ours[1].forward(x, threads=1), ref) > bound  # another expert's weights


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_the_ggml_formats_give_kt_the_very_blocks_fiddler_packs(quant):
    kernels()
    mod = load()
    assert mod.FORMATS[quant].quant == quant and mod.FORMATS[quant].kt_weights == "ggml"
    w = mod.random_experts(2, 64, 256)
    blocks = mod.ggml_blocks(quant, *w)
    from fiddler.quant import row_bytes

    assert [tuple(b.shape) for b in blocks] == [(2, 256, row_bytes(64, quant))] * 2 + [(2, 64, row_bytes(256, quant))]
    ours = mod.fiddler_experts(quant, *w, blocks)
    for e in range(2):
        assert all(torch.equal(a, b[e]) for a, b in zip(ours[e].blocks(), blocks))


def test_relative_error_is_against_the_reference_scale():
    mod = load()
    ref = torch.tensor([[2.0, -4.0]])
    assert mod.rel_err(ref, ref) == 0.0
    assert mod.rel_err(torch.tensor([[2.0, -3.0]]), ref) == pytest.approx(0.25)
