"""Cited modelling parameters of the `*_original` systems (the systems as the Fiddler paper ran them).

Every parameter of such a system's simulation is a `Cited(value, source)`; `source` is one of
- `owner/repo@<commit>:<path>#L<a>[-<b>]`: the line(s) of the released code that fix the value,
- `arXiv:2402.07033 §<section>`: the paper,
- `results/measured/<dir>/<file>`: a measurement of this project (the file names the CPU and the method),
- `assumption: <why>`: where no source fixes it (stated, and listed in validation.md as an assumption).
tests/test_original_citations.py fails on any parameter whose source is not in one of these forms.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

CODE_RE = re.compile(r"^[\w.-]+/[\w.-]+@[0-9a-f]{7,40}:[\w./-]+#L\d+(-\d+)?$")
PAPER_RE = re.compile(r"^arXiv:2402\.07033 §[\w. -]+$")
MEASURED_RE = re.compile(r"^results/measured/[\w.-]+/[\w.-]+$")
ASSUMPTION_RE = re.compile(r"^assumption: \S.{10,}$")


@dataclass(frozen=True)
class Cited:
    value: Any
    source: str  # one or more citations, separated by " + "
    what: str = ""

    def citations(self) -> list[str]:
        return [s.strip() for s in self.source.split(" + ")]


def citation_problem(source: str) -> str | None:
    """None when every part of `source` is a citation in one of the forms above, else what is wrong."""
    for part in (s.strip() for s in source.split(" + ")):
        if not any(r.match(part) for r in (CODE_RE, PAPER_RE, MEASURED_RE, ASSUMPTION_RE)):
            return f"{part!r} is not owner/repo@commit:path#Lx-y, arXiv:2402.07033 §..., results/measured/... or assumption: ..."
    return None


def table(params: dict[str, Cited]) -> list[dict[str, Any]]:
    """Rows for validation.md: name, value, source, what."""
    return [{"name": k, "value": v.value, "source": v.source, "what": v.what} for k, v in params.items()]
