"""Every table this project writes as text goes through here (pandas in, text out): the run tables, the
paper tables and the validation.

    render(df, [Col("environment", "environment"), Col("e2e_tok_s", "e2e tok/s", 2)], head=["Numbers: ..."])

The rules, in one place:
- a column whose shown value is the same on every row (two rows or more) leaves the table for a header
  line (`environment: paper_env1 · numbers: simulated`); a column that is empty on every row is dropped;
- numbers are right-aligned at a fixed precision per column (`Col.digits`); text is left-aligned;
- `mean ± sd` only where a row has more than one repetition (`Col.sd` names the sd column, `reps` the
  repetitions column); one repetition shows the mean alone;
- Markdown cells are padded to the column's width, so the text reads as a table in a terminal too.

`fmt` is md (the default), csv, json or jsonl. The machine formats keep every selected column and the raw
values (no lifting, no rounding beyond %.6g), keyed by `Col.key`.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import pandas as pd

from fiddler.plain import plain

FORMATS = ("md", "csv", "json", "jsonl")
SEP = " · "


@dataclass(frozen=True)
class Col:
    """One column: the frame's `key`, its `title`; `digits` makes it a number column at that precision."""

    key: str
    title: str
    digits: int | None = None
    suffix: str = ""  # after a number, e.g. "x" for a speedup
    scale: float = 1.0  # shown = value x scale (seconds as ms)
    sd: str | None = None  # the sd column: "mean ± sd" where the row's repetitions > 1
    lift: bool = True  # may leave the table for the header line when constant

    @property
    def numeric(self) -> bool:
        return self.digits is not None


def present(value: Any) -> bool:
    """A value that is there: not None, not NaN, not ''."""
    if value is None:
        return False
    if isinstance(value, float) and math.isnan(value):
        return False
    try:
        if pd.isna(value):
            return False
    except (TypeError, ValueError):
        pass
    return value != ""


def number(value: Any, digits: int, suffix: str = "", scale: float = 1.0) -> str:
    """A number at fixed precision; a nonzero value too small for it keeps `digits` significant digits
    (0.0004 is not shown as 0.00). Text (a status such as `skipped`) passes through."""
    if not present(value):
        return ""
    try:
        v = float(value) * scale
    except (TypeError, ValueError):
        return str(value)
    if v != 0 and abs(v) < 0.5 * 10 ** -digits:
        return f"{v:.{max(1, digits)}g}{suffix}"
    return f"{v:.{digits}f}{suffix}"


def cell(row: dict, col: Col, reps_key: str | None) -> str:
    value = row.get(col.key)
    if not col.numeric:
        return " ".join(str(value).split()) if present(value) else ""
    text = number(value, col.digits, col.suffix, col.scale)
    if col.sd and text and _reps(row, reps_key) > 1 and present(row.get(col.sd)):
        text += f" ± {float(row.get(col.sd)) * col.scale:.{col.digits}f}"  # the mean's precision, always
    return text


def _reps(row: dict, reps_key: str | None) -> int:
    if reps_key is None:
        return 2  # no repetitions column: a given sd is shown
    v = row.get(reps_key)
    return int(v) if present(v) else 1


def render(df: pd.DataFrame, cols: Sequence[Col], *, head: Iterable[str] = (), fmt: str = "md",
           reps: str | None = None, lift: bool = True, empty: str = "(no rows)") -> str:
    """The table as text (see the module's docstring). `head`: lines above it (each its own paragraph)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown table format {fmt!r}: one of {', '.join(FORMATS)}")
    cols = [c for c in cols if c.key in df.columns]
    if fmt != "md":
        return machine(df[[c.key for c in cols]] if cols else df, fmt)
    rows = [r for _, r in df.iterrows()]
    shown = {c.key: [cell(r.to_dict(), c, reps) for r in rows] for c in cols}
    keep, lifted = [], []
    for c in cols:
        values = shown[c.key]
        if not any(values):
            continue
        if lift and c.lift and len(values) > 1 and len(set(values)) == 1:
            lifted.append(f"{c.title}: {values[0]}")
            continue
        keep.append(c)
    out = [line for line in head if line]
    if lifted:
        out.append(SEP.join(lifted))
    if not rows:
        return "\n\n".join(out + [empty])
    if not keep:  # every column was lifted: the header line says it all
        return "\n\n".join(out)
    out.append(markdown([c.title for c in keep], [[shown[c.key][i] for c in keep] for i in range(len(rows))],
                        [c.numeric for c in keep]))
    return "\n\n".join(out)


def markdown(titles: Sequence[str], body: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """A Markdown table with every cell padded to its column's width; `right` aligns a column right."""
    esc = [[str(v).replace("|", "\\|") for v in row] for row in body]
    titles = [t.replace("|", "\\|") for t in titles]
    widths = [max([len(t), 3] + [len(row[i]) for row in esc]) for i, t in enumerate(titles)]

    def line(values) -> str:
        return "| " + " | ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if r else ("-" * (w + 2)) for w, r in zip(widths, right)) + "|"
    return "\n".join([line(titles), rule] + [line(row) for row in esc])


def _plain(value: Any) -> Any:
    """A cell as a machine format writes it: empty as None, numpy values as Python ones (fiddler.plain, the one
    converter), floats at 6 significant digits."""
    if not present(value):
        return None
    value = plain(value)
    if isinstance(value, float):
        return float(f"{value:.6g}")
    return value


def machine(df: pd.DataFrame, fmt: str) -> str:
    """csv, json (a list of objects) or jsonl, with fixed float formatting (the same bytes for the same
    numbers)."""
    if fmt == "csv":
        buf = io.StringIO()
        df.to_csv(buf, index=False, float_format="%.6g", lineterminator="\n")
        return buf.getvalue().rstrip("\n")
    objs = [{str(k): _plain(v) for k, v in r.items()} for r in df.to_dict(orient="records")]
    if fmt == "json":
        return json.dumps(objs, indent=1, sort_keys=False)
    return "\n".join(json.dumps(o, sort_keys=False) for o in objs)


def auto_digits(values: Iterable[Any]) -> int | None:
    """A fixed precision for a column of numbers: three significant digits at the column's median magnitude
    (21.7 and 22.0, not 21.7 and 22; a ratio as 1.00, not 1), 0 for whole numbers; None when the column holds
    text."""
    nums = []
    for v in values:
        if not present(v):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "dtype"):
            return None
        nums.append(float(v))
    if not nums:
        return None
    if all(v == int(v) for v in nums):
        return 0
    nonzero = sorted(abs(v) for v in nums if v)
    if not nonzero:
        return 0
    median = nonzero[len(nonzero) // 2]
    return max(0, min(4, 2 - math.floor(math.log10(median))))


def auto_columns(df: pd.DataFrame, titles: dict[str, str] | None = None) -> list[Col]:
    """A Col per frame column, each number column at its auto_digits precision."""
    titles = titles or {}
    return [Col(k, titles.get(k, k), auto_digits(df[k])) for k in df.columns]


def records(rows: Sequence[dict], **kw) -> str:
    """A table of plain rows (dicts; a key missing in a row is an empty cell): bools as yes / **no**, numbers at
    auto precision. For reports whose rows are built as dicts (runners/validate_sim.py)."""
    if not rows:
        return "(none)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    df = pd.DataFrame([{k: (("yes" if r.get(k) else "**no**") if isinstance(r.get(k), bool) else r.get(k))
                        for k in keys} for r in rows], columns=keys, dtype=object)
    return render(df, auto_columns(df), **kw)
