"""Extracting a downloaded tar archive without letting it write outside the destination, on every Python
the project allows (>= 3.10; tarfile.data_filter exists only from 3.10.12 / 3.11.4 on).

Every member is checked first (plain files, directories and links only; no absolute path, no '..'
component, no link whose target leaves the destination), so a bad archive is refused before anything is
written. Then tarfile's "data" filter does the extraction where it exists; elsewhere members are extracted
one by one, each target resolved against what is already on disk (a link extracted earlier may redirect a
later path), without the archive's owners or permission bits (the "data" filter drops those too).
"""
from __future__ import annotations

import os
import posixpath
import tarfile
from pathlib import Path


class UnsafeTarError(ValueError):
    """An archive member would land outside the destination, or is not a plain file, directory or link."""


def _refuse(tar: tarfile.TarFile, m: tarfile.TarInfo, why: str) -> UnsafeTarError:
    return UnsafeTarError(f"{tar.name or 'archive'}: refusing to extract {m.name!r}: {why}")


def _lexical_problem(m: tarfile.TarInfo) -> str | None:
    """What is wrong with a member from its name and link target alone."""
    if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
        return "not a plain file, directory or link"
    if m.name.startswith("/") or os.path.isabs(m.name):
        return "absolute path"
    if ".." in m.name.split("/"):
        return "'..' in its path"
    if m.issym():
        if m.linkname.startswith("/") or os.path.isabs(m.linkname):
            return f"symlink to the absolute path {m.linkname!r}"
        if posixpath.normpath(posixpath.join(posixpath.dirname(m.name), m.linkname)).split("/")[0] == "..":
            return f"symlink to {m.linkname!r}, outside the destination"
    if m.islnk() and (m.linkname.startswith("/") or ".." in m.linkname.split("/")):
        return f"hard link to {m.linkname!r}, outside the destination"
    return None


def _inside(root: str, path: str) -> bool:
    path = os.path.realpath(path)
    return path == root or path.startswith(root + os.sep)


def _resolved_problem(m: tarfile.TarInfo, root: str) -> str | None:
    """What is wrong with a member given what is already extracted under root (realpath'd)."""
    target = os.path.join(root, m.name)
    if not _inside(root, target):
        return "its path resolves outside the destination (through a link)"
    if m.issym() and not _inside(root, os.path.join(os.path.dirname(target), m.linkname)):
        return f"symlink to {m.linkname!r} resolves outside the destination"
    if m.islnk() and not _inside(root, os.path.join(root, m.linkname)):
        return f"hard link to {m.linkname!r} resolves outside the destination"
    return None


def extract(tar: tarfile.TarFile, dest: str | os.PathLike, members: list[tarfile.TarInfo] | None = None) -> None:
    """Extract `members` (default: all) of `tar` into dest; UnsafeTarError names the first member that
    would leave it."""
    members = tar.getmembers() if members is None else list(members)
    for m in members:
        why = _lexical_problem(m)
        if why:
            raise _refuse(tar, m, why)
    Path(dest).mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(dest)
    if hasattr(tarfile, "data_filter"):
        try:
            tar.extractall(root, members=members, filter="data")
        except tarfile.FilterError as e:
            raise _refuse(tar, e.tarinfo, str(e)) from e
        return
    # this Python's tarfile has no filters: resolve each member against the disk as it is extracted
    trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
    for m in members:
        why = _resolved_problem(m, root)
        if why:
            raise _refuse(tar, m, why)
        tar.extract(m, root, set_attrs=False, **trusted)
