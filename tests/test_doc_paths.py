"""Every repository path README.md, ARCHITECTURE.md and docs/ name exists: a file or folder of the tree, or
a glob matching one. Paths the harness writes (git-ignored: results/runs/, results/index.jsonl, ...) and
templates (`<name>`, `{x}`) are not repository paths."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("fiddler", "systems", "runners", "conf", "scripts", "tests", "benchmarks", "results", "docs", ".ci", ".github")
PATH = re.compile(r"(?<![\w.@:/-])((?:%s)/[\w./*+-]*)" % "|".join(re.escape(t) for t in TOP))
FILES = ("run.py", "setup.py", "pyproject.toml", "README.md", "ARCHITECTURE.md")


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]


def named_paths(text: str) -> set[str]:
    out = set()
    for m in PATH.finditer(text):
        end = m.end()
        if end < len(text) and text[end] in "<{":  # a template: conf/system/<name>.yaml
            continue
        out.add(m.group(1).rstrip(".,:;)*"))
    return out


def ignored(paths: list[str]) -> set[str]:
    res = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(paths),
                         capture_output=True, text=True)
    return set(res.stdout.split())


def missing_paths(doc: Path) -> list[str]:
    paths = sorted(named_paths(doc.read_text()))
    skip = ignored(paths)
    return [p for p in paths if p not in skip and not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]


def test_the_path_finder():
    text = "see `fiddler/engine.py`, conf/system/<name>.yaml, results/measured/*/README.md and ./x/fiddler/y.py."
    assert named_paths(text) == {"fiddler/engine.py", "results/measured/*/README.md"}


def test_every_path_the_guides_name_exists():
    docs = documents()
    assert len(docs) >= 3
    bad = {str(d.relative_to(ROOT)): m for d in docs if (m := missing_paths(d))}
    assert not bad, bad
    for doc in docs:  # root files named in backquotes
        for name in re.findall(r"`([\w.-]+\.(?:py|toml|md))`", doc.read_text()):
            if name in FILES:
                assert (ROOT / name).exists(), (doc, name)


def test_the_readme_is_a_guide_not_a_manual():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    # CI (.ci/run) runs the quick start as written: the install, the first run and the test command
    text = "\n".join(lines)
    for command in ("scripts/install.sh && . .venv/bin/activate", "python run.py system=fiddler workload=beam",
                    "python -m pytest -q"):
        assert command in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/install.sh" in ci and "python run.py system=fiddler workload=beam" in ci and "pytest -q" in ci
