"""The one-command install: llama.cpp's build flags follow the CPU (never AMX), and the script is valid."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from baselines.llama_cpp.build_flags import ALWAYS_OFF, cmake_args

ROOT = Path(__file__).resolve().parents[1]
HASWELL = {"avx": True, "os_avx": True, "avx2": True, "fma": True, "f16c": True, "bmi2": True}
SKYLAKE_X = {**HASWELL, "avx512f": True, "avx512bw": True, "avx512vl": True, "avx512dq": True, "os_avx512": True}
SAPPHIRE = {**SKYLAKE_X, "avx512_vbmi": True, "avx512_vnni": True, "avx512_bf16": True, "amx_tile": True,
            "amx_bf16": True, "os_amx": True}


def flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args)


def test_flags_follow_the_cpu():
    h = flags(cmake_args(HASWELL, "x86_64"))
    assert h["GGML_NATIVE"] == "OFF" and h["GGML_AVX2"] == h["GGML_FMA"] == h["GGML_F16C"] == "ON"
    assert all(h[k] == "OFF" for k in h if k.startswith("GGML_AVX512"))
    s = flags(cmake_args(SKYLAKE_X, "x86_64"))
    assert s["GGML_AVX512"] == "ON" and s["GGML_AVX512_BF16"] == s["GGML_AVX512_VNNI"] == "OFF"
    r = flags(cmake_args(SAPPHIRE, "x86_64", cuda=True))
    assert r["GGML_AVX512_BF16"] == r["GGML_AVX512_VNNI"] == r["GGML_AVX512_VBMI"] == "ON" and r["GGML_CUDA"] == "ON"
    for f in (h, s, r):
        assert all(f[k] == "OFF" for k in ALWAYS_OFF)  # never llama.cpp's AMX path
    # AVX-512 instructions without the OS saving ZMM state are unusable
    assert flags(cmake_args({**SKYLAKE_X, "os_avx512": False}, "x86_64"))["GGML_AVX512"] == "OFF"
    assert cmake_args(None, "aarch64") == ["-DGGML_NATIVE=ON"]


def test_flags_of_this_host_match_proc_cpuinfo():
    out = subprocess.run([sys.executable, "-m", "baselines.llama_cpp.build_flags", "--cuda", "off"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    f = flags(out)
    cpuinfo = set(next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), []))
    assert f["GGML_AVX2"] == ("ON" if "avx2" in cpuinfo else "OFF")
    assert f["GGML_AVX512"] == ("ON" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpuinfo else "OFF")
    assert f["GGML_AVX512_BF16"] == ("ON" if "avx512_bf16" in cpuinfo else "OFF")


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (apt-get install qemu-user)")
def test_flags_under_an_emulated_haswell_leave_out_avx512():
    """What scripts/install.sh would build on a Haswell: AVX2 yes, no AVX-512 (which would SIGILL there)."""
    r = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", sys.executable, "-m", "baselines.llama_cpp.build_flags",
                        "--cuda", "off"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    f = flags(r.stdout.split())
    assert f["GGML_AVX2"] == f["GGML_FMA"] == "ON"
    assert all(v == "OFF" for k, v in f.items() if k.startswith(("GGML_AVX512", "GGML_AMX")))


def test_install_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "install.sh")]).returncode == 0
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/install.sh" in ci and "python -m pytest -q" in ci and "scripts/regress.py --quick" in ci
