"""Hugging Face checkpoint -> GGUF, with llama.cpp's own converter and quantizer.

The converter (``convert_hf_to_gguf.py`` plus its sibling ``conversion/`` package and the vendored
``gguf-py``) ships only in llama-cpp-python's *source* distribution, not in the wheel, and this
project does not copy llama.cpp's code. So the converter is located, in this order:

1. ``converter_dir`` argument / ``FIDDLER_LLAMA_CPP_CONVERTER`` environment variable: a llama.cpp
   source tree (or any directory holding ``convert_hf_to_gguf.py`` and its siblings);
2. the per-user cache ``<cache root>/llama_cpp_converter/<CONVERTER_VERSION>`` where the cache
   root is ``$FIDDLER_CACHE`` (the runner's ``cache_dir`` default), else ``~/.cache/fiddler``;
3. otherwise it is fetched into that cache with ``pip download`` of llama-cpp-python==CONVERTER_VERSION's
   sdist (pinned: its sha256 must be SDIST_SHA256's), and only the converter files are extracted, with
   path checks (safe_tar).

``python -m systems.llama_cpp.convert --fetch`` does step 3 ahead of time (install step);
``python -m systems.llama_cpp.convert MODEL_DIR --quant bf16`` converts by hand.

Outputs are cached under ``<cache_dir>/llama_cpp/gguf/<content hash>-<quant>.gguf`` where the hash
covers every file of the checkpoint directory and the llama-cpp-python version (a different
converter may write a different file). Each has its sha256 beside it (``<name>.gguf.sha256``, in
sha256sum's format), checked at every use: a damaged or unrecorded GGUF is converted again.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from systems.base import SystemUnavailable
from systems import safe_tar
from fiddler.integrity import file_sha256, warn_rebuild

EXTRA_HINT = 'pip install -e ".[llamacpp]" (see README, "llama.cpp baseline", for the CMAKE_ARGS)'

#: quant types llama.cpp's HF converter writes directly
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")

#: quant types produced by llama.cpp's quantizer (``llama_model_quantize``) from a bf16 GGUF;
#: values are the names of the ``LLAMA_FTYPE_MOSTLY_*`` constants of llama_cpp.
#: Types that need an importance matrix (IQ1/IQ2/IQ3 families, Q2_K_S) are deliberately absent.
QUANTIZER_TYPES = {
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
    "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "q3_k_s": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
    "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "q3_k_l": "LLAMA_FTYPE_MOSTLY_Q3_K_L",
    "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q5_k_s": "LLAMA_FTYPE_MOSTLY_Q5_K_S",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
    "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
}

SUPPORTED_QUANTS = CONVERTER_TYPES + tuple(QUANTIZER_TYPES)

#: the llama-cpp-python sdist the converter comes from (the version this project verified), and the sha256
#: of each sdist it downloads (PyPI's file; pip checks the index's hash as well)
CONVERTER_VERSION = "0.3.36"
SDIST_SHA256 = {"0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}

_CONVERTER_FILES = ("convert_hf_to_gguf.py",)
_CONVERTER_DIRS = ("conversion", "gguf-py")  # conversion/ exists from llama.cpp ~b8000 on


class GGUFConversionError(RuntimeError):
    """The checkpoint could not be converted to / quantized as GGUF (first line says why)."""


def llama_cpp_python_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError as exc:
        raise SystemUnavailable(f"llama-cpp-python is not installed; install the extra: {EXTRA_HINT}") from exc


def _user_cache_root() -> Path:
    """The project's cache root: $FIDDLER_CACHE, else $XDG_CACHE_HOME/fiddler, else ~/.cache/fiddler."""
    if os.environ.get("FIDDLER_CACHE"):
        return Path(os.environ["FIDDLER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fiddler"


def _is_converter_dir(path: Path) -> bool:
    return (path / "convert_hf_to_gguf.py").is_file() and (path / "gguf-py").is_dir()


def default_converter_dir(version: str | None = None) -> Path:
    return _user_cache_root() / "llama_cpp_converter" / (version or CONVERTER_VERSION)


def fetch_converter(dest: Path, version: str, quiet: bool = True) -> Path:
    """Download llama-cpp-python==version's sdist with pip and extract the converter into dest."""
    from filelock import FileLock

    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if _is_converter_dir(dest):
            return dest
        with tempfile.TemporaryDirectory(prefix="llama_cpp_sdist_") as tmp:
            try:
                sdist = download_sdist(version, Path(tmp))
            except RuntimeError as exc:
                raise SystemUnavailable(
                    f"llama.cpp's HF->GGUF converter is not available: {exc}. "
                    f"Run `python -m systems.llama_cpp.convert --fetch` on a machine with network and copy "
                    f"{dest} here, or point FIDDLER_LLAMA_CPP_CONVERTER at a llama.cpp source tree.") from exc
            staging = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
            try:
                _extract_converter(sdist, staging)
                if not _is_converter_dir(staging):
                    raise SystemUnavailable(f"{sdist.name} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
                os.replace(staging, dest)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return dest


def download_sdist(version: str, into: Path) -> Path:
    """llama-cpp-python==version's source distribution (it vendors llama.cpp), downloaded with pip and
    checked against SDIST_SHA256 (ValueError naming both hashes when it differs)."""
    expected = SDIST_SHA256.get(version)
    if expected is None:
        raise ValueError(f"no sha256 is pinned for llama-cpp-python=={version}'s sdist (pinned: "
                         f"{', '.join(SDIST_SHA256)}; systems/llama_cpp/convert.py SDIST_SHA256)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps",
           "--disable-pip-version-check", "-d", str(into), f"llama-cpp-python=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    sdists = sorted(Path(into).glob("llama_cpp_python-*.tar.gz"))
    if proc.returncode != 0 or not sdists:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"could not download the llama-cpp-python=={version} source distribution "
                           f"(no network?)\n{tail}")
    got = file_sha256(sdists[0])
    if got != expected:
        raise ValueError(f"{sdists[0].name}: sha256 {got}, expected {expected} (pinned for llama-cpp-python=="
                         f"{version}); not using it")
    return sdists[0]


def _extract_converter(sdist: Path, out: Path) -> None:
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts
            # <top>/vendor/llama.cpp/<rel...>
            if len(parts) < 4 or parts[1:3] != ("vendor", "llama.cpp"):
                continue
            rel = parts[3:]
            if (len(rel) == 1 and rel[0] in _CONVERTER_FILES) or rel[0] in _CONVERTER_DIRS or rel[0] == "LICENSE":
                if not (m.isfile() or m.isdir()):
                    continue
                m = copy.copy(m)
                m.name = str(Path(*rel))
                members.append(m)
        safe_tar.extract(tar, out, members)


def find_converter(converter_dir: str | os.PathLike | None = None, fetch: bool = True) -> Path:
    """Directory holding convert_hf_to_gguf.py, fetched on first use (see module docstring)."""
    explicit = converter_dir or os.environ.get("FIDDLER_LLAMA_CPP_CONVERTER")
    if explicit:
        path = Path(explicit).expanduser()
        if not _is_converter_dir(path):
            raise SystemUnavailable(
                f"{path} is not a llama.cpp converter directory (needs convert_hf_to_gguf.py and gguf-py/)")
        return path
    version = CONVERTER_VERSION
    dest = default_converter_dir(version)
    if _is_converter_dir(dest):
        return dest
    if not fetch:
        raise SystemUnavailable(f"llama.cpp converter not found at {dest}; run `python -m systems.llama_cpp.convert --fetch`")
    return fetch_converter(dest, version)


def checkpoint_hash(model_dir: str | os.PathLike, memo_path: str | os.PathLike | None = None) -> str:
    """sha256 over the names and contents of every regular file in the checkpoint directory (the
    engine's fiddler.quant.checkpoint_hash, so both caches key a checkpoint alike), remembered in
    ``memo_path`` per (name, size, mtime_ns) so multi-GiB checkpoints are read once."""
    from fiddler.quant import checkpoint_hash as content_hash

    root = Path(model_dir)
    if not any(p.is_file() and not p.name.startswith(".") for p in root.iterdir()):
        raise GGUFConversionError(f"GGUF conversion failed: {root} holds no files")
    return content_hash(root, memo_path)


def _first_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):  # the last exception line or logger error is the most specific
        if "Error" in ln or "error" in ln.lower() or "not supported" in ln:
            return ln
    return lines[-1] if lines else "(no output)"


#: families whose converter class reads a BPE tokenizer.json; with only a SentencePiece tokenizer.model
#: (the generated checkpoints) their vocabulary goes through the converter's SentencePiece path (spm_convert.py)
SPM_FORCED_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2", "deepseek_v3")


def needs_spm_vocab(model_dir: Path) -> bool:
    """A SentencePiece-only checkpoint of a family whose converter class expects a BPE tokenizer.json."""
    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (model_type in SPM_FORCED_TYPES and (Path(model_dir) / "tokenizer.model").is_file()
            and not (Path(model_dir) / "tokenizer.json").is_file())


def run_converter(model_dir: Path, out: Path, outtype: str, converter: Path) -> None:
    """Run llama.cpp's converter in a subprocess (own memory, own imports of the vendored gguf-py); through
    spm_convert.py where the vocabulary must come from tokenizer.model (see needs_spm_vocab)."""
    args = [str(model_dir), "--outfile", str(out), "--outtype", outtype]
    if needs_spm_vocab(model_dir):
        cmd = [sys.executable, str(Path(__file__).with_name("spm_convert.py")), str(converter), *args]
    else:
        cmd = [sys.executable, str(converter / "convert_hf_to_gguf.py"), *args]
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0 or not out.is_file():
        log = (proc.stderr or "") + (proc.stdout or "")
        reason = _first_error_line(log)
        if "is not supported" in reason:
            raise SystemUnavailable(f"llama.cpp cannot represent this checkpoint: {reason}")
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise GGUFConversionError(
            f"GGUF conversion of {model_dir} failed: {reason}\n"
            f"command: {' '.join(cmd)}\n--- converter output (tail) ---\n{tail}")


#: quant types the like-for-like ("pure") policy supports: every expert and attention projection in that
#: type, token embeddings bf16 and the output matrix left as it is (bf16) -- what fiddler's
#: Engine.from_pretrained(quant=...) runs
PURE_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}
GGML_TYPE_BF16 = 30  # ggml.h enum ggml_type (llama-cpp-python does not export it)


def quantize(src: Path, out: Path, quant: str, threads: int, pure: bool = False) -> None:
    """llama_model_quantize from the bf16 GGUF `src`. pure: the like-for-like policy (PURE_TYPES):
    pure=True, quantize_output_tensor=False, token_embedding_type=BF16; else llama.cpp's own mix
    for the type (e.g. Q4_0 keeps attn_v in Q8_0, the output in Q6_K and quantizes the embeddings)."""
    import llama_cpp

    name = PURE_TYPES[quant] if pure else QUANTIZER_TYPES[quant]
    ftype = getattr(llama_cpp, name, None)
    if ftype is None:
        raise SystemUnavailable(f"the installed llama-cpp-python has no {name}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = max(1, threads)
    if pure:
        params.pure = True
        params.quantize_output_tensor = False
        params.token_embedding_type = GGML_TYPE_BF16
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0 or not out.is_file():
        raise GGUFConversionError(f"GGUF quantization to {quant} failed: llama_model_quantize returned {rc} for {src}")


def _sha256_record(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".sha256")


def _cached_gguf_problem(gguf: Path) -> str | None:
    """None when the cached GGUF's bytes have the sha256 recorded when it was made, else what is wrong."""
    try:
        recorded = _sha256_record(gguf).read_text().split()[0]
    except (OSError, IndexError):
        return "no recorded sha256 (cached before GGUFs were verified, or the record was lost)"
    got = file_sha256(gguf)
    if got != recorded:
        return f"sha256 {got[:16]}..., recorded {recorded[:16]}...: the file is damaged"
    return None


def _publish(tmp: Path, out: Path) -> None:
    """A finished GGUF into the cache, with its sha256 beside it. A crash between the two renames leaves a
    GGUF whose record is missing or stale, which the next use converts again."""
    digest = file_sha256(tmp)
    os.replace(tmp, out)
    record = _sha256_record(out)
    rtmp = record.with_name(record.name + f".tmp{os.getpid()}")
    rtmp.write_text(f"{digest}  {out.name}\n")
    os.replace(rtmp, record)


def ensure_gguf(model_dir: str | os.PathLike, quant: str, cache_dir: str | os.PathLike,
                converter_dir: str | os.PathLike | None = None, threads: int = 1, pure: bool = False) -> Path:
    """The GGUF of ``model_dir`` in ``quant``, converted (and quantized) once and cached. pure: the
    like-for-like policy for q8_0 / q4_0 (see `quantize`), quantized from the bf16 GGUF."""
    from filelock import FileLock

    quant = quant.lower()
    if quant not in SUPPORTED_QUANTS:
        raise ValueError(f"llama_cpp quant {quant!r} is not supported; choose one of {', '.join(SUPPORTED_QUANTS)}")
    if pure and quant not in PURE_TYPES:
        raise ValueError(f"the pure (like-for-like) policy supports {', '.join(PURE_TYPES)}, not {quant!r}")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise GGUFConversionError(f"GGUF conversion failed: {model_dir} is not a Hugging Face checkpoint (no config.json)")
    out_dir = Path(cache_dir) / "llama_cpp" / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir / "hash_memo.json.lock")):
        ckpt = checkpoint_hash(model_dir, out_dir / "hash_memo.json")
    key = hashlib.sha256(f"{ckpt}|llama-cpp-python={llama_cpp_python_version()}".encode()).hexdigest()[:20]
    out = out_dir / f"{key}-{quant}{'-pure' if pure else ''}.gguf"
    with FileLock(str(out) + ".lock"):
        if out.is_file():
            problem = _cached_gguf_problem(out)
            if problem is None:
                return out
            warn_rebuild(out, problem, "converting it again")
            out.unlink()
        if quant in CONVERTER_TYPES and not pure:
            converter = find_converter(converter_dir)
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            try:
                run_converter(model_dir, tmp, quant, converter)
                _publish(tmp, out)
            finally:
                tmp.unlink(missing_ok=True)
        else:
            src = ensure_gguf(model_dir, "bf16", cache_dir, converter_dir, threads)
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            try:
                quantize(src, tmp, quant, threads, pure=pure)
                _publish(tmp, out)
            finally:
                tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", nargs="?", help="Hugging Face checkpoint directory to convert")
    ap.add_argument("--fetch", action="store_true", help="fetch llama.cpp's converter into the user cache and exit")
    ap.add_argument("--quant", default="bf16", choices=SUPPORTED_QUANTS)
    ap.add_argument("--cache-dir", default=str(_user_cache_root()))
    ap.add_argument("--converter-dir", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--pure", action="store_true", help="q8_0/q4_0 like for like with fiddler's quant: "
                    "experts and attention in the type, embeddings and output bf16")
    args = ap.parse_args(argv)
    if args.fetch:
        print(find_converter(args.converter_dir))
        if not args.model_dir:
            return 0
    if not args.model_dir:
        ap.error("model_dir is required unless --fetch is given")
    print(ensure_gguf(args.model_dir, args.quant, args.cache_dir, args.converter_dir, args.threads, args.pure))
    return 0


if __name__ == "__main__":
    sys.exit(main())
