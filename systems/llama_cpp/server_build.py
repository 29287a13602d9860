"""llama.cpp's own HTTP server (`llama-server`, continuous batching over --parallel slots), built from the
llama.cpp that llama-cpp-python's pinned sdist vendors: the same source the install compiles into the Python
package and takes the GGUF converter from (systems/llama_cpp/convert.py), with the same CPU flags
(systems/llama_cpp/build_flags.py: this CPU's instruction sets, never AMX).

    python -m systems.llama_cpp.server_build          # build once (minutes), print the binary's path
    python -m systems.llama_cpp.server_build --where  # the path it would use, built or not

The binary is kept at <cache root>/llama_server/<version>/<key>/llama-server, the key hashing the CMake flags
and the compiler, so a build for another CPU's flags is never picked up (it could die with SIGILL).
FIDDLER_LLAMA_SERVER points at a llama-server of one's own instead. The build is offline once the sdist is
there: the web UI is left out (LLAMA_BUILD_UI=OFF, no prebuilt UI download) and so is OpenSSL.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from systems import safe_tar

from .convert import CONVERTER_VERSION, _user_cache_root, download_sdist

#: CMake options of the server build beside the CPU flags: a static binary of the server alone, offline
BUILD_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_OPENSSL=OFF")


def cpu_flags() -> list[str]:
    """This CPU's llama.cpp flags, as scripts/install.sh builds llama-cpp-python with ($CMAKE_ARGS first)."""
    if os.environ.get("CMAKE_ARGS"):
        return os.environ["CMAKE_ARGS"].split()
    from .build_flags import cmake_args, detected_features, has_cuda

    return cmake_args(detected_features(), cuda=has_cuda())


def build_key(flags: list[str], compiler: str) -> str:
    return hashlib.sha256("\n".join([CONVERTER_VERSION, *BUILD_OPTIONS, *flags, compiler]).encode()).hexdigest()[:12]


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return cxx


def binary_path(flags: list[str] | None = None) -> Path:
    """Where the server for these flags (default: this CPU's) is kept."""
    key = build_key(cpu_flags() if flags is None else flags, _compiler())
    return _user_cache_root() / "llama_server" / CONVERTER_VERSION / key / "llama-server"


def find_llama_server() -> Path | None:
    """FIDDLER_LLAMA_SERVER, else this CPU's cached build; None where neither is there."""
    own = os.environ.get("FIDDLER_LLAMA_SERVER")
    if own:
        return Path(own) if os.access(own, os.X_OK) else None
    try:
        path = binary_path()
    except (OSError, RuntimeError):
        return None
    return path if os.access(path, os.X_OK) else None


def _extract_llama_cpp(sdist: Path, out: Path) -> Path:
    """The sdist's vendor/llama.cpp tree into out (path-checked); its root."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if Path(m.name).parts[1:3] == ("vendor", "llama.cpp")]
        safe_tar.extract(tar, out, members)
    (top,) = {Path(m.name).parts[0] for m in members}
    return out / top / "vendor" / "llama.cpp"


def build(flags: list[str] | None = None, jobs: int | None = None) -> Path:
    """Build llama-server for these flags (default: this CPU's) unless already built; its path."""
    flags = cpu_flags() if flags is None else flags
    dest = binary_path(flags)
    if os.access(dest, os.X_OK):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama_server_", dir=dest.parent) as tmp:
        src = _extract_llama_cpp(download_sdist(CONVERTER_VERSION, Path(tmp)), Path(tmp) / "src")
        bld = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(bld), *BUILD_OPTIONS, *flags], check=True)
        subprocess.run(["cmake", "--build", str(bld), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 1)],
                       check=True)
        staged = Path(tmp) / "llama-server"
        shutil.copy2(bld / "bin" / "llama-server", staged)
        os.replace(staged, dest)  # whole, or not there
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--where", action="store_true", help="print where the binary is (or would be) and exit")
    ap.add_argument("-j", "--jobs", type=int, default=None)
    args = ap.parse_args(argv)
    if args.where:
        print(find_llama_server() or binary_path())
        return 0
    try:
        print(build(jobs=args.jobs))
    except (subprocess.CalledProcessError, RuntimeError, ValueError) as e:
        print(f"llama-server build failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
