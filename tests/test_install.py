"""The one-command install: llama.cpp's build flags follow the CPU (never AMX), and the script is valid."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from systems.llama_cpp import convert
from systems.llama_cpp.build_flags import ALWAYS_OFF, cmake_args

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
    out = subprocess.run([sys.executable, "-m", "systems.llama_cpp.build_flags", "--cuda", "off"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    f = flags(out)
    cpuinfo = set(next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), []))
    assert f["GGML_AVX2"] == ("ON" if "avx2" in cpuinfo else "OFF")
    assert f["GGML_AVX512"] == ("ON" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpuinfo else "OFF")
    assert f["GGML_AVX512_BF16"] == ("ON" if "avx512_bf16" in cpuinfo else "OFF")


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (apt-get install qemu-user)")
def test_flags_under_an_emulated_haswell_leave_out_avx512():
    """What scripts/install.sh would build on a Haswell: AVX2 yes, no AVX-512 (which would SIGILL there)."""
    r = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", sys.executable, "-m", "systems.llama_cpp.build_flags",
                        "--cuda", "off"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    f = flags(r.stdout.split())
    assert f["GGML_AVX2"] == f["GGML_FMA"] == "ON"
    assert all(v == "OFF" for k, v in f.items() if k.startswith(("GGML_AVX512", "GGML_AMX")))


def test_install_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "install.sh")]).returncode == 0
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/install.sh" in ci and "python -m pytest -q" in ci and "scripts/regress.py --quick" in ci


# What llama_backend_init does (llama.cpp's src/llama.cpp): the f16 tables via ggml_init, then the
# backend registry, which initialises the CPU backend.
_BACKEND_INIT = r"""
#include <stdio.h>
#include "ggml.h"
#include "ggml-backend.h"
int main(void) {
  ggml_time_init();
  struct ggml_init_params params = {0, NULL, false};
  ggml_free(ggml_init(params));
  printf("backends %zu\n", ggml_backend_reg_count());
  return 0;
}
"""


def _ggml_sources(cache: Path, version: str) -> Path:
    """llama.cpp's ggml/ from llama-cpp-python's sdist (the pinned version), cached."""
    import tarfile
    import tempfile

    from systems import safe_tar
    from systems.llama_cpp.convert import download_sdist

    dest = cache / "llama_cpp_ggml_src" / version
    if (dest / "ggml" / "CMakeLists.txt").exists():
        return dest / "ggml"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            sdist = download_sdist(version, Path(tmp))
        except RuntimeError as exc:
            pytest.skip(str(exc).splitlines()[0])
        staging = Path(tempfile.mkdtemp(dir=cache))
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                parts = Path(m.name).parts
                if len(parts) > 4 and parts[1:4] == ("vendor", "llama.cpp", "ggml") and (m.isfile() or m.isdir()):
                    m.name = str(Path(*parts[3:]))
                    members.append(m)
            safe_tar.extract(tar, staging, members)  # filter="data" exists only from 3.10.12 / 3.11.4 on
        # the sdist leaves out ggml's pkg-config template, which its CMakeLists configures
        pc = staging / "ggml" / "ggml.pc.in"
        if not pc.exists():
            pc.write_text("Name: ggml\nDescription: ggml\nVersion: @GGML_VERSION@\n")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging.replace(dest)
    return dest / "ggml"


def _build_backend_init(src: Path, build: Path, args: list[str]) -> Path:
    """ggml built with these flags, and the llama_backend_init sequence linked against it (cached)."""
    exe = build / "backend_init"
    if exe.exists():
        return exe
    run = lambda cmd: subprocess.run(cmd, capture_output=True, text=True, check=True)  # noqa: E731
    run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
         "-DGGML_BACKEND_DL=OFF", "-DGGML_OPENMP=OFF", "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF", *args])
    run(["cmake", "--build", str(build), "--target", "ggml", "-j", "2"])
    (build / "backend_init.c").write_text(_BACKEND_INIT)
    libs = [str(next(build.rglob(f"lib{name}.a"))) for name in ("ggml", "ggml-cpu", "ggml-base")]
    run(["g++", "-O1", "-x", "c", str(build / "backend_init.c"), "-x", "none", f"-I{src / 'include'}", *libs,
         "-lpthread", "-lm", "-o", str(exe)])
    return exe


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("qemu-x86_64") is None or shutil.which("cmake") is None,
                    reason="needs qemu-user and cmake")
def test_llama_cpp_built_with_the_chosen_flags_starts_on_haswell():
    """The fixed AVX-512 flag list the README once gave dies with SIGILL in llama_backend_init on an
    (emulated) Haswell; the flags build_flags chooses for a Haswell start there."""
    pytest.importorskip("llama_cpp")
    import hashlib
    import os
    import signal

    version = convert.CONVERTER_VERSION  # the pinned sdist (its sha256 is checked); ggml's flags matter here
    cache = Path(os.environ.get("FIDDLER_CACHE", Path.home() / ".cache" / "fiddler"))
    src = _ggml_sources(cache, version)
    old_fixed = cmake_args(SAPPHIRE, "x86_64")  # == the README's former hard-coded CMAKE_ARGS
    chosen = cmake_args(HASWELL, "x86_64")
    results = {}
    for name, args in (("fixed", old_fixed), ("chosen", chosen)):
        key = hashlib.sha1(" ".join(args).encode()).hexdigest()[:12]
        exe = _build_backend_init(src, cache / "ggml_builds" / version / key, args)
        results[name] = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", str(exe)], capture_output=True, text=True,
                                       timeout=300)
    assert results["fixed"].returncode == -signal.SIGILL, results["fixed"]  # the failure is real here...
    assert results["chosen"].returncode == 0, results["chosen"].stderr[-2000:]  # ...and the choice avoids it
    assert results["chosen"].stdout.startswith("backends ")
