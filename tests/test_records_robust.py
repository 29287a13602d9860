"""The index and the tables survive any bytes and any JSON shape: a bad line is reported with
file:line and skipped, and a row is never `ok` without its metrics. Run files get the user's umask.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

from runners import records, tables
from tests.test_harness import _job

tables_script = tables  # the command is runners.tables.main

GOOD = {"schema_version": 1, "run_id": "r1", "time": "2026-01-01T00:00:00+00:00", "status": "ok", "reason": None,
        "system": "s", "model": "m", "workload": "w", "environment": "e", "mode": "execute",
        "point": {"input_len": 8, "output_len": 4, "beam_width": 1}, "config_hash": "h1",
        "metrics": {"ttft_s": 0.5, "prefill_tok_s": 16.0, "decode_tok_s": 3.0, "e2e_tok_s": 2.0,
                    "ttft_s_sd": 0.0, "repetitions": 3, "valid": True, "best": {"ttft_s": 0.4}}}


def test_non_utf8_index_line_is_skipped_and_the_run_goes_on(tmp_path, capsys):
    """Bug 3: one non-UTF-8 byte in the index stopped everything with a UnicodeDecodeError."""
    (tmp_path / "index.jsonl").write_bytes(b"\xff\n")
    with pytest.warns(UserWarning, match=r"index.jsonl:1: damaged record line skipped"):
        recs = _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline")
    assert [r["status"] for r in recs] == ["ok"]
    assert "index.jsonl:1: damaged" in capsys.readouterr().err


def test_tables_script_skips_non_utf8_lines(tmp_path, capsys):
    """Bug 3, runners/tables.py: the same byte crashed the table builder."""
    path = tmp_path / "index.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe garbage\n")
    with pytest.warns(UserWarning, match=r"index.jsonl:2"):
        assert tables_script.main([str(path)]) == 0
    out = capsys.readouterr()
    assert "index.jsonl:2: damaged record line skipped" in out.err and "| s " in out.out


@pytest.mark.parametrize("bad, why", [
    ({"status": "ok", "point": None}, "point"),
    ({"status": "ok", "time": 5, "point": {"input_len": "a"}}, "time"),
    ({"status": "ok"}, "point"),
    ({**GOOD, "metrics": None}, "without metrics"),
    ({**GOOD, "metrics": {"ttft_s": 1.0}}, "without metrics"),
    ({**GOOD, "metrics": {**GOOD["metrics"], "e2e_tok_s": "fast"}}, "without metrics"),
    ({**GOOD, "status": "error", "metrics": {"ttft_s": "x"}}, "metrics.ttft_s"),
    ({**GOOD, "status": "done"}, "status"),
    ({**GOOD, "point": {"input_len": True, "output_len": 4, "beam_width": 1}}, "point"),
    ({**GOOD, "config": [1, 2]}, "config"),
    ({**GOOD, "metrics": {**GOOD["metrics"], "best": [1]}}, "metrics.best"),
])
def test_wrong_shapes_are_reported_and_never_an_ok_row(tmp_path, capsys, bad, why):
    """Bug 4: valid JSON of the wrong shape crashed runners/tables.py (AttributeError, TypeError) or
    became an `ok` row of nan."""
    path = tmp_path / "index.jsonl"
    path.write_text(json.dumps(bad) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.warns(UserWarning, match=r"index.jsonl:1: damaged record line skipped"):
        assert tables_script.main([str(path)]) == 0
    out = capsys.readouterr()
    assert why in out.err.splitlines()[0]
    rows = [line for line in out.out.splitlines() if line.startswith("| s ")]
    assert len(rows) == 1 and "0.500 ± 0.000" in rows[0]  # only the good record, with its metrics


def test_every_json_shape_either_tables_or_is_reported(tmp_path):
    """Any JSON value on a line: the reader and the table builder never raise."""
    shapes = [None, 1, "s", [], [GOOD], {}, {"status": None}, {"status": "ok", "point": {}},
              {**GOOD, "point": {"input_len": 1.5, "output_len": 1, "beam_width": 1}},
              {**GOOD, "metrics": {**GOOD["metrics"], "ttft_s": float("nan")}}, {**GOOD, "system": {"a": 1}},
              {**GOOD, "config": {"system": {"planner": [1, {"x": None}]}}}, "[" * 100000]
    path = tmp_path / "index.jsonl"
    path.write_text("".join((s if isinstance(s, str) and s.startswith("[") else json.dumps(s)) + "\n"
                            for s in shapes) + json.dumps(GOOD) + "\n")
    with pytest.warns(UserWarning):
        recs = records.read_records(path)
    table = tables.build(recs)
    assert len(recs) == 2 and list(table["status"]) == ["ok", "ok"]
    assert "planner" in tables.to_markdown(table)


def test_run_files_get_the_users_umask(tmp_path):
    """Run files were created with mode 0600 (mkstemp), whatever the umask."""
    old = os.umask(0o022)
    try:
        _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline")
        os.umask(0o002)
        records.atomic_write_text(tmp_path / "group.txt", "x")
    finally:
        os.umask(old)
    for name in ("records.jsonl", "table.md", "table.csv"):
        assert (tmp_path / "run" / name).stat().st_mode & 0o777 == 0o644, name
    assert (tmp_path / "group.txt").stat().st_mode & 0o777 == 0o664


def _script(name: str):
    if name in ("tables", "compare"):  # commands of their runners modules (python -m runners.<name>)
        return importlib.import_module(f"runners.{name}")
    spec = importlib.util.spec_from_file_location(f"{name}_script", Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _set(rec: dict, path: str, value) -> dict:
    """A deep copy of rec with the dotted path set to value (its parents made objects where needed)."""
    rec = json.loads(json.dumps(rec))
    *parents, leaf = path.split(".")
    node = rec
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[leaf] = value
    return rec


# every nested field the table tools (runners/tables.py, compare.py, plot.py) take apart, each with values of a
# kind they cannot use; the probes first
ODD_FIELDS = [("host", "x"), ("environment_info", "x"), ("decode_bound", [1, 2]), ("config.environment", "x"),
              ("point.concurrency", [1]), ("host", [1]), ("host.cpu_name", [1]), ("host.cpu_name", {"a": 1}),
              ("environment_info", [1]), ("decode_bound", "x"), ("decode_bound.fraction", [1]),
              ("decode_bound.fraction.best", "x"), ("decode_bound.fraction.best", [1]), ("config.environment", [1]),
              ("point.concurrency", "x"), ("point.concurrency", 1.5), ("point.concurrency", True), ("raw", "x"),
              ("raw", [1])]


@pytest.mark.parametrize("path, value", ODD_FIELDS, ids=[f"{p}={json.dumps(v)}" for p, v in ODD_FIELDS])
def test_table_tools_skip_a_line_with_an_odd_field_naming_file_line_and_field(tmp_path, capsys, path, value):
    """Bug 10 (issue 55): `"host":"x"`, `"environment_info":"x"`, `"decode_bound":[1,2]`, config.environment a
    string or a list inside `point` crashed runners/tables.py, compare.py and plot.py (AttributeError,
    TypeError, exit 1). Each tool now skips that line, says file:line and which field, and goes on."""
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps(_set(GOOD, path, value)) + "\n" + json.dumps(GOOD) + "\n")
    field = path.split(".")[0]
    for tool, argv in (("tables", [str(index)]), ("compare", [str(index), str(index)]),
                       ("plot", [str(index), "--x", "input_len", "--y", "e2e_tok_s", "--format", "svg",
                                 "--out", str(tmp_path / "plot")])):
        with pytest.warns(UserWarning, match=r"index.jsonl:1: damaged record line skipped"):
            assert _script(tool).main(argv) == 0, tool
        out = capsys.readouterr()
        skipped = [line for line in out.err.splitlines() if "index.jsonl:1: damaged record line skipped" in line]
        assert skipped and field in skipped[0], (tool, out.err)
        assert "index.jsonl:2" not in out.err, (tool, out.err)  # the good line is used


@pytest.mark.parametrize("bad", [{**GOOD, "metrics": {**GOOD["metrics"], "tokens": 0}},
                                 {**GOOD, "raw": {"ttft_s": [0.5, 0.5], "decode_s": [1.0, 1.0], "tokens": [4, 0]}}],
                         ids=["metrics.tokens", "raw.tokens"])
def test_an_ok_record_with_0_tokens_is_reported_never_valid(tmp_path, capsys, bad):
    """An `ok` line with 0 tokens was shown as a row reading `valid: True`: no measurement made of nothing is."""
    path = tmp_path / "index.jsonl"
    path.write_text(json.dumps(bad) + "\n" + json.dumps({**GOOD, "system": "t"}) + "\n")
    with pytest.warns(UserWarning, match=r"index.jsonl:1: damaged record line skipped"):
        assert tables_script.main([str(path)]) == 0
    out = capsys.readouterr()
    assert "tokens" in out.err.splitlines()[0]
    with pytest.warns(UserWarning):
        assert list(tables.build(records.read_records(path))["system"]) == ["t"]
