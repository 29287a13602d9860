"""The import graph of the tree: no circle, and `fiddler/` (the library) imports no harness.

Every import statement of every module counts, the ones inside functions included (a lazy import still
makes a circle: it only moves the failure to the first call that takes it). An edge goes to the most
precise module named: `from a.b import c` is a.b.c where that is a module, else a.b."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fiddler", "systems", "runners", "benchmarks", "tests")
HARNESS = ("systems", "runners", "benchmarks", "tests", "scripts", "hydra", "run")

# circles that are another issue's to break, each as the sorted modules of its strongly connected component
KNOWN = {
    # the kernel bindings' (fiddler/kernels/: tuning <-> packed, probe, quant, settings), the kernel-bindings
    # issue's to break
    ("fiddler.kernels.packed", "fiddler.kernels.probe", "fiddler.kernels.quant", "fiddler.kernels.settings",
     "fiddler.kernels.tuning"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    found["run"] = ROOT / "run.py"
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The tree's modules `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a non-module attribute path: its longest module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(g: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(tuple(sorted(comp)))
    return sorted(out)


def test_circles_are_found_through_function_level_imports(tmp_path):
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert circles(g) == [("a", "b", "c")]
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from fiddler import engine\n    import runners.schema\n")
    assert imports("m", mod, {"fiddler": mod, "fiddler.engine": mod, "runners": mod, "runners.schema": mod}) \
        == {"fiddler.engine", "runners.schema"}


def test_no_import_circle():
    found = set(circles(graph()))
    assert found <= set(KNOWN), sorted(found - set(KNOWN))


def test_the_library_imports_no_harness():
    bad = {m: sorted(t for t in targets if t.split(".")[0] in HARNESS)
           for m, targets in graph().items() if m.split(".")[0] == "fiddler"}
    assert not {m: t for m, t in bad.items() if t}


def test_mixtral_offloadings_cache_rules_import_without_torch():
    """The config and the cache rules its simulator shares with its executor (systems/mixtral_offloading/
    cache.py) import without torch: the start-up checks load every system's config."""
    import subprocess
    import sys

    code = ("import sys, systems.mixtral_offloading.cache, systems.mixtral_offloading.config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120).stdout.strip()
    assert out == "False"
