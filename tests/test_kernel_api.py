"""The kernel library's interface, declared once in csrc/fk_api.h: the Python bindings read from it must
agree with what the compiler makes of it, the library must export exactly what it declares, the shared
constants must be the library's, and fiddler.kernels must import nothing else from fiddler. Each check is
also run on a deliberately broken copy, to show that it can fail."""
from __future__ import annotations

import ast
import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fiddler.kernels as fk
from fiddler.kernels import _lib, constants

KERNELS = Path(fk.__file__).resolve().parent
needs_lib = pytest.mark.skipif(not fk.is_available(), reason=f"kernel library not built: {fk.load_error()}")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to compile the check")

# what a ctypes type in the table means on the C side, as a type trait of T
_TRAITS = {
    None: "std::is_same_v<T, void>",
    ctypes.c_int: "std::is_same_v<T, int>",
    ctypes.c_int64: "std::is_same_v<T, int64_t>",
    ctypes.c_float: "std::is_same_v<T, float>",
    ctypes.c_double: "std::is_same_v<T, double>",
    ctypes.c_char_p: "std::is_same_v<T, const char*>",
    ctypes.c_void_p: "(std::is_pointer_v<T> && !std::is_same_v<T, const char*>)",
}


def compile_check(sigs: dict, header_dir: Path) -> str:
    """The compiler's objections to a Python table {name: (restype, argtypes)} against fk_api.h in
    header_dir: "" when every entry point has that many arguments of those types and that return type."""
    lines = ['#include "fk_api.h"', "#include <cstdint>", "#include <tuple>", "#include <type_traits>",
             "template <class F> struct sig;",
             "template <class R, class... A> struct sig<R(A...)> { using ret = R; using args = std::tuple<A...>; };"]
    for i, (ct, trait) in enumerate(_TRAITS.items()):
        lines.append(f"template <class T> constexpr bool is_{i} = {trait};")
    trait_of = {ct: f"is_{i}" for i, ct in enumerate(_TRAITS)}
    for name, (res, args) in sigs.items():
        s = f"sig<decltype({name})>"
        lines.append(f'static_assert(std::tuple_size_v<{s}::args> == {len(args)}, '
                     f'"{name}: the Python table has {len(args)} arguments");')
        rname = getattr(res, "__name__", "void")
        lines.append(f'static_assert({trait_of[res]}<{s}::ret>, "{name}: return type is not {rname}");')
        for i, a in enumerate(args):
            lines.append(f"static_assert({trait_of[a]}<std::tuple_element_t<{i} < std::tuple_size_v<{s}::args> ? {i} "
                         f': 0, {s}::args>>, "{name}: argument {i} is not {a.__name__}");')
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-I", str(header_dir), "-x", "c++", "-"],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
    return "" if r.returncode == 0 else r.stderr


def exported_symbols(path: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("fk_")}


def export_mismatch(declared: set[str], exported: set[str]) -> dict:
    return {k: sorted(v) for k, v in (("declared, not exported", declared - exported),
                                       ("exported, not declared", exported - declared)) if v}


# ------------------------------------------------------------------ the header and the bindings
@needs_lib
def test_bindings_are_the_header_as_parsed():
    sigs = _lib.parse_header(_lib.HEADER.read_text())
    assert sigs == _lib.SIGNATURES and len(sigs) >= 49
    for name, (res, args) in sigs.items():
        f = getattr(_lib.lib, name)
        assert f.restype == res and f.argtypes == args, name


@needs_gxx
def test_python_table_compiles_against_the_header():
    assert compile_check(_lib.parse_header(_lib.HEADER.read_text()), _lib.HEADER.parent) == ""


@needs_gxx
def test_a_broken_header_or_table_fails_the_check(tmp_path):
    text = _lib.HEADER.read_text()
    sigs = _lib.parse_header(text)
    # the header changed under the table: fk_packed_bytes's n narrowed to int
    decl = "FK_API int64_t fk_packed_bytes(int64_t n, int64_t k, int groups);"
    assert decl in text
    (tmp_path / "fk_api.h").write_text(text.replace(decl, decl.replace("int64_t n", "int n")))
    err = compile_check(sigs, tmp_path)
    assert "fk_packed_bytes: argument 0 is not" in err
    # the table changed under the header: fk_linear's token count as c_int, fk_qmode given an argument
    broken = dict(sigs)
    res, args = sigs["fk_linear"]
    broken["fk_linear"] = (res, args[:4] + [ctypes.c_int] + args[5:])
    broken["fk_qmode"] = (ctypes.c_int, [ctypes.c_int])
    err = compile_check(broken, _lib.HEADER.parent)
    assert "fk_linear: argument 4" in err and "fk_qmode: the Python table has 1 arguments" in err
    broken = {"fk_last_error": (ctypes.c_void_p, [])}  # a C string bound as an address
    assert "fk_last_error: return type" in compile_check(broken, _lib.HEADER.parent)


def test_parser_takes_only_the_documented_form():
    ok = "typedef void (*fk_cb_fn)(const void* ctx);\nFK_API int fk_a(int64_t n, const char* s, fk_cb_fn f, float* p);"
    assert _lib.parse_header(ok) == {"fk_a": (ctypes.c_int, [ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p,
                                                              ctypes.c_void_p])}
    for bad in ("FK_API int fk_a(int n,\n  int k);",  # two lines
                "FK_API int fk_a(bool b);",  # a type the table has no fixed width for
                "FK_API int fk_a(size_t n);",
                "FK_API int fk_a(int);",  # no name
                "FK_API int fk_a(void (*f)(int));",  # a callback not behind a typedef
                "FK_API int fk_a();\nFK_API int fk_a();",  # twice
                "typedef int myint;",
                "FK_API void* fk_a()",  # no semicolon
                ""):
        with pytest.raises(_lib.HeaderError):
            _lib.parse_header(bad)


@needs_lib
def test_library_exports_exactly_the_header():
    if shutil.which("nm") is None:
        pytest.skip("no nm")
    exported = exported_symbols(_lib.library_path())
    assert export_mismatch(set(_lib.SIGNATURES), exported) == {}
    assert export_mismatch(set(_lib.SIGNATURES) | {"fk_gone"}, exported | {"fk_extra"}) == {
        "declared, not exported": ["fk_gone"], "exported, not declared": ["fk_extra"]}


# ------------------------------------------------------------------ the shared constants
@needs_lib
def test_constants_are_the_librarys():
    L = _lib.lib
    names = []
    while (n := L.fk_constant_name(len(names))) is not None:
        names.append(n.decode())
    lib_values = {n: L.fk_constant(n.encode()) for n in names}
    assert lib_values == constants.exported()
    assert L.fk_constant(b"no.such") == -1 and "no.such" in _lib.last_error()


def test_constants_need_nothing_imported():
    tree = ast.parse((KERNELS / "constants.py").read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [(i.module, [a.name for a in i.names]) for i in imports] == [("__future__", ["annotations"])]
    assert constants.row_bytes("q4_0", 33) == 36 and constants.matrix_bytes(3, 64, "q8_0") == 3 * 68
    assert constants.matrix_bytes(3, 64, None, 2) == 384


# ------------------------------------------------------------------ kernels/ stands alone
def outside_imports(source: str, filename: str = "<src>") -> list[str]:
    """Imports (anywhere: module level or inside functions) of fiddler modules outside fiddler.kernels,
    in a module of fiddler/kernels/."""
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:  # from .. import x: the package above kernels/
                bad.append(f"{filename}:{node.lineno}: from {'.' * node.level}{node.module or ''}")
                continue
            mods = [] if node.level else [node.module or ""]
        else:
            continue
        bad += [f"{filename}:{node.lineno}: {m}" for m in mods
                if re.match(r"fiddler(\.|$)", m) and not re.match(r"fiddler\.kernels(\.|$)", m)]
    return bad


def test_kernels_import_nothing_else_from_fiddler():
    files = sorted(KERNELS.glob("*.py"))
    assert len(files) >= 10
    assert [b for f in files for b in outside_imports(f.read_text(), f.name)] == []
    broken = ("import fiddler.kernels.quant\n"  # allowed: the package itself
              "def f():\n    from fiddler.latency import best_time\n    import fiddler.config\n    from ..quant import x\n")
    assert outside_imports(broken) == ["<src>:3: fiddler.latency", "<src>:4: fiddler.config", "<src>:5: from ..quant"]
    assert len((KERNELS / "__init__.py").read_text().splitlines()) < 250


def test_model_sizes_need_neither_fiddler_quant_nor_the_engine():
    """fiddler.config's byte counts (placement, simulate mode) take the block sizes from the constants, so
    importing the config no longer runs through fiddler.quant into model/weights and back."""
    code = ("import sys; from fiddler.config import MoEConfig\n"
            "c = MoEConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_experts=8, top_k=2, num_heads=4,"
            " num_kv_heads=2, head_dim=16, vocab_size=32)\n"
            "print(c.expert_bytes(quant='q4_0'), c.expert_bytes(quant='q8_0'), c.expert_bytes(),"
            " sorted(m for m in ('fiddler.quant', 'fiddler.model', 'fiddler.weights') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # w1, w3 [96, 64] and w2 [64, 96]: 2 * 96 * 2 + 64 * 3 blocks
    assert r.stdout.split("[")[0].split() == [str(18 * (2 * 96 * 2 + 64 * 3)), str(34 * (2 * 96 * 2 + 64 * 3)),
                                               str(2 * 3 * 64 * 96)]
    assert r.stdout.strip().endswith("[]")
