"""Reading the Markdown tables runners/table_format.py writes: cells without their padding, so tests check
values, not spacing."""
from __future__ import annotations


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def tables(md: str) -> list[list[list[str]]]:
    """Every table: its header row, then its body rows (the rule line left out)."""
    out, cur = [], None
    for line in md.splitlines():
        if line.startswith("|"):
            if cur is None:
                cur = []
                out.append(cur)
            if set(line.replace("|", "").strip()) <= {"-", ":"}:
                continue
            cur.append(_cells(line))
        else:
            cur = None
    return out


def rows(md: str) -> list[list[str]]:
    """Every body row of every table."""
    return [r for t in tables(md) for r in t[1:]]


def has_row(md: str, *cells: str) -> bool:
    """A body row holding these cells side by side (anywhere in the row)."""
    n = len(cells)
    return any(list(cells) == r[i:i + n] for r in rows(md) for i in range(len(r) - n + 1))


def lifted(md: str) -> dict[str, str]:
    """The header lines' constant columns (`key: value · key: value`), merged over the text."""
    out = {}
    for line in md.splitlines():
        if " · " in line or (": " in line and not line.startswith(("|", "#", "Numbers"))):
            for part in line.split(" · "):
                k, sep, v = part.partition(": ")
                if sep:
                    out[k.strip()] = v.strip()
    return out


def dicts(md: str) -> list[dict[str, str]]:
    """Every body row as {column title: cell}, with the lifted constant columns of the text added."""
    const = lifted(md)
    return [{**const, **dict(zip(t[0], r))} for t in tables(md) for r in t[1:]]
