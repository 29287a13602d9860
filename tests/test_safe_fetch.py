"""Fetched archives cannot write outside their destination on any Python the project allows (3.10.0-3.10.11
and 3.11.0-3.11.3 have no tarfile.data_filter), and the llama.cpp converter's source is the pinned sdist
(issue 20)."""
from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from systems.llama_cpp import convert

TOP = "llama_cpp_python-0.3.36/vendor/llama.cpp/"


def _tar(path: Path, members: list[tarfile.TarInfo | tuple[str, bytes]]) -> Path:
    """A .tar.gz of regular files (name, content) and ready-made TarInfos (links), names taken as given."""
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tar.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                tar.addfile(info, io.BytesIO(m[1]))
    return path


def _link(name: str, target: str, hard: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = (tarfile.LNKTYPE if hard else tarfile.SYMTYPE), target
    return info


def _fifo(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.FIFOTYPE
    return info


@pytest.fixture
def no_data_filter(monkeypatch):
    """This Python as one before 3.10.12 / 3.11.4: no tarfile.data_filter, so the project's own checks run."""
    monkeypatch.delattr(tarfile, "data_filter", raising=False)


def test_converter_extraction_refuses_traversal_without_data_filter(tmp_path, no_data_filter):
    sdist = _tar(tmp_path / "llama_cpp_python-0.3.36.tar.gz", [
        (TOP + "convert_hf_to_gguf.py", b"# converter\n"), (TOP + "gguf-py/__init__.py", b""),
        (TOP + "gguf-py/../../x", b"outside")])
    out = tmp_path / "a" / "b" / "out"
    out.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"gguf-py/\.\./\.\./x"):
        convert._extract_converter(sdist, out)
    assert not list(tmp_path.rglob("x"))


UNSAFE = {
    "absolute path": [("{tmp}/abs/x", b"")],  # under the test's own directory, should it be written
    "dot-dot": [("../x", b"")],
    "dot-dot inside a path": [("d/../../x", b"")],
    "symlink out": [_link("l", "../outside")],
    "absolute symlink": [_link("l", "/etc")],
    "hardlink out": [_link("h", "../outside", hard=True)],
    # each link alone points inside; the second resolves through the first to the parent
    "symlink chain": [_link("l1", "."), _link("l2", "l1/..")],
    "a fifo": [_fifo("p")],  # nothing but files, directories and links
}


@pytest.mark.parametrize("own_checks", [True, False], ids=["own checks", "data filter where available"])
@pytest.mark.parametrize("case", list(UNSAFE))
def test_safe_extract_refuses_members_that_leave_the_destination(tmp_path, monkeypatch, case, own_checks):
    from systems import safe_tar

    if own_checks:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    (tmp_path / "outside").write_text("keep")
    dest = tmp_path / "dest"
    dest.mkdir()
    members = [(m[0].format(tmp=tmp_path), m[1]) if isinstance(m, tuple) else m for m in UNSAFE[case]]
    archive = _tar(tmp_path / "t.tar.gz", [("ok.txt", b"fine"), *members])
    with tarfile.open(archive) as tar, pytest.raises(safe_tar.UnsafeTarError, match="refusing to extract"):
        safe_tar.extract(tar, dest)
    assert (tmp_path / "outside").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "outside", "t.tar.gz"]


def test_safe_extract_own_checks_extract_files_dirs_and_inside_links(tmp_path, no_data_filter):
    from systems import safe_tar

    archive = _tar(tmp_path / "t.tar.gz", [("d/a.txt", b"A"), ("d/e/b.txt", b"B"), _link("d/l", "e/b.txt"),
                                           _link("h", "d/a.txt", hard=True)])
    dest = tmp_path / "dest"
    with tarfile.open(archive) as tar:
        safe_tar.extract(tar, dest)
    assert (dest / "d" / "l").read_text() == "B" and (dest / "h").read_text() == "A"


def test_converter_sdist_must_match_the_pinned_sha256(tmp_path, monkeypatch):
    """pip fetches the sdist (its own index hash check untouched); a file that is not the pinned one is
    refused, naming both hashes."""
    fake = b"not the sdist"

    def fake_pip(cmd, **kw):
        (Path(cmd[cmd.index("-d") + 1]) / "llama_cpp_python-0.3.36.tar.gz").write_bytes(fake)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(convert.subprocess, "run", fake_pip)
    with pytest.raises(ValueError) as err:
        convert.download_sdist("0.3.36", tmp_path)
    assert hashlib.sha256(fake).hexdigest() in str(err.value)
    assert convert.SDIST_SHA256["0.3.36"] in str(err.value)
