"""Build of the C++ CPU expert kernel (fiddler/kernels/csrc) as part of the normal install.

Metadata lives in pyproject.toml; this file only declares the native library. It is a plain shared
library loaded with ctypes: no libtorch or Python headers at build time (pip's isolated build would
resolve a different torch than the installed one), no -march=native (each ISA file selects its own
target with `#pragma GCC target`, and the library picks a path at run time from CPUID).
"""
import glob
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

# Every source and header of csrc/, no hand-kept list: a new file is built (and a changed header rebuilds
# everything) without an edit here. Sorted, so the link order does not depend on the file system.
CSRC = "fiddler/kernels/csrc"
SOURCES = sorted(glob.glob(f"{CSRC}/*.cpp"))
HEADERS = sorted(glob.glob(f"{CSRC}/*.h"))


class BuildKernels(build_ext):
    def build_extensions(self):
        compiler = self.compiler.compiler_cxx[0] if getattr(self.compiler, "compiler_cxx", None) else None
        if compiler and shutil.which(compiler) is None:
            raise SystemExit(
                f"fiddler-moe: no C++ compiler found (looked for '{compiler}'). The CPU expert kernel is "
                "compiled at install time; install g++ >= 11 (Debian/Ubuntu: apt-get install g++) "
                "or set CXX to a C++17 compiler, then rerun pip install."
            )
        try:
            super().build_extensions()
        except Exception as e:  # compiler present but failing (too old for AMX/AVX512-BF16 intrinsics, ...)
            raise SystemExit(
                f"fiddler-moe: building the CPU expert kernel failed: {e}\n"
                "It needs a C++17 compiler with AVX512-BF16 and AMX intrinsics (GCC >= 11 or Clang >= 12)."
            ) from e

    def get_export_symbols(self, ext):
        return []  # a ctypes library, not a Python module: there is no PyInit_ symbol


# conf/ and results/reference/ travel in the wheel as systems/_data/ (systems/paths.py reads them there when no
# checkout is around the code), so an installed harness runs from any directory
SHIPPED = {"conf": "systems/_data/conf", "results/reference": "systems/_data/reference"}


class BuildPy(build_py):
    def run(self):
        super().run()
        for src, dst in SHIPPED.items():
            shutil.copytree(src, os.path.join(self.build_lib, dst), dirs_exist_ok=True)


setup(
    ext_modules=[
        Extension(
            "fiddler.kernels._fiddler_cpu",
            sources=SOURCES,
            depends=HEADERS,
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-math-errno", "-pthread", "-g0"],
            extra_link_args=["-pthread"],
        )
    ],
    cmdclass={"build_ext": BuildKernels, "build_py": BuildPy},
)
