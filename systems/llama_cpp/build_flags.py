"""CMake flags for building llama-cpp-python for *this* CPU (used by scripts/install.sh).

llama.cpp's GGML_NATIVE=ON compiles for the build machine with -march=native, which also enables its
AMX path: on some CPUs quantized GGUFs then die with an illegal instruction there. Hard-coding the
AVX-512 flags instead (as the README once did) builds fine on an AVX2-only CPU and dies with SIGILL in
llama_backend_init. So the flags are read off the CPU, through the same CPUID detection as the
project's kernel library (its fk_feature CPUID/XCR0 checks, which also answer under an emulated CPU),
and AMX is always off.

    CMAKE_ARGS="$(python -m systems.llama_cpp.build_flags)" pip install llama-cpp-python
"""
from __future__ import annotations

import argparse
import importlib.util
import platform
import shutil
import subprocess
from pathlib import Path

# llama.cpp's GGML_* x86 options and the CPUID features each needs (all of them)
X86_OPTIONS = (
    ("GGML_AVX", ("avx", "os_avx")),
    ("GGML_AVX2", ("avx2", "os_avx")),
    ("GGML_FMA", ("fma", "os_avx")),
    ("GGML_F16C", ("f16c", "os_avx")),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "os_avx512")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512_vbmi", "os_avx512")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni", "os_avx512")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16", "os_avx512")),
)
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def has_cuda() -> bool:
    """An NVIDIA driver that answers (then llama.cpp is built with CUDA, as the README says)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cmake_args(features: dict | None, machine: str | None = None, cuda: bool = False) -> list[str]:
    """-D options for this CPU: features as fiddler.kernels.features() reports them (None: not x86)."""
    machine = (machine or platform.machine()).lower()
    args = ["-DGGML_NATIVE=OFF"]
    if machine in ("x86_64", "amd64") and features is not None:
        for opt, need in X86_OPTIONS:
            args.append(f"-D{opt}={'ON' if all(features.get(f) for f in need) else 'OFF'}")
        args += [f"-D{opt}=OFF" for opt in ALWAYS_OFF]
    else:  # other architectures: llama.cpp's own detection for the build machine is right there
        args = ["-DGGML_NATIVE=ON"]
    if cuda:
        args.append("-DGGML_CUDA=ON")
    return args


def detected_features() -> dict | None:
    """CPUID features as the kernel library detects them (None: no x86 build of it). The library is
    loaded by path, without torch, so this also runs quickly under an emulated CPU."""
    spec = importlib.util.find_spec("fiddler")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("build_flags: the fiddler package is not installed (pip install -e . first)")
    path = Path(next(iter(spec.submodule_search_locations))) / "kernels" / "_lib.py"
    lib_spec = importlib.util.spec_from_file_location("_fiddler_kernel_lib", path)
    mod = importlib.util.module_from_spec(lib_spec)
    lib_spec.loader.exec_module(mod)
    L = mod.lib
    if L is None:
        raise SystemExit(f"build_flags: {mod.load_error}")
    if not L.fk_compiled_x86():
        return None
    return {L.fk_feature_name(i).decode(): bool(L.fk_feature(i)) for i in range(L.fk_num_features())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", choices=["auto", "on", "off"], default="auto")
    args = ap.parse_args(argv)
    features = detected_features()
    cuda = has_cuda() if args.cuda == "auto" else args.cuda == "on"
    print(" ".join(cmake_args(features, cuda=cuda)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
