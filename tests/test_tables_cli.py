"""runners/tables.py's formats, filters and pivot on hand-made records, including a set that mixes simulated
and measured rows (never one row, never averaged) and a configuration missing for one system."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from runners import tables
from tests import md_table

ROOT = Path(__file__).resolve().parents[1]


def rec(system, tok, *, input_len=32, model="m", workload="w", env="e", mode="execute", time="2026-12-01T10:00:00",
        reps=1, status="ok"):
    return {"system": system, "model": model, "workload": workload, "environment": env, "mode": mode,
            "status": status, "reason": None if status == "ok" else "no GPU", "time": time, "run_id": "r",
            "point": {"input_len": input_len, "output_len": 8, "beam_width": 1},
            "host": {"cpu_name": "Test CPU"}, "config": {"system": {"name": system}},
            "environment_info": {"simulated": mode == "simulate"},
            "metrics": {"e2e_tok_s": tok, "e2e_tok_s_sd": 0.1, "ttft_s": 0.5, "prefill_tok_s": 64.0,
                        "decode_tok_s": tok, "repetitions": reps}
            if status == "ok" else None}


RECS = [rec("fiddler", 20.0), rec("llama_cpp", 10.0), rec("fiddler", 40.0, input_len=64),  # llama_cpp lacks 64
        rec("fiddler", 8.0, mode="simulate"), rec("llama_cpp", 2.0, mode="simulate"),
        rec("deepspeed", None, status="skipped"),
        rec("fiddler", 99.0, model="other", time="2026-11-01T00:00:00")]


def run(tmp_path, *args):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECS))
    res = subprocess.run([sys.executable, "-m", "runners.tables", str(path), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    return res


def test_pivot_puts_systems_in_columns_with_speedups_and_keeps_provenances_apart():
    df = tables.build(RECS)
    out, cols = tables.pivot(df[df["model"] == "m"], "system", "e2e_tok_s", "llama_cpp")
    rows = {(r["provenance"], r["input"]): r for _, r in out.iterrows()}
    assert rows[("measured", 32)]["fiddler / llama_cpp"] == pytest.approx(2.0)
    assert rows[("simulated", 32)]["fiddler / llama_cpp"] == pytest.approx(4.0)  # never 20 / 2 across provenances
    assert rows[("measured", 64)]["fiddler"] == 40.0 and pd.isna(rows[("measured", 64)]["fiddler / llama_cpp"])
    assert rows[("measured", 32)]["deepspeed"] == "skipped"
    assert pd.isna(rows[("measured", 32)]["deepspeed / llama_cpp"])
    with pytest.raises(ValueError, match="baseline 'nope'"):
        tables.pivot(df, "system", "e2e_tok_s", "nope")
    # times: the baseline's over the system's
    t, _ = tables.pivot(df[(df["model"] == "m") & (df["provenance"] == "measured")], "system", "ttft_s", "llama_cpp")
    assert t.iloc[0]["fiddler / llama_cpp"] == pytest.approx(1.0)


def test_filters_by_model_workload_environment_mode_status_and_date():
    assert {r["model"] for r in tables.select(RECS, model=["other"])} == {"other"}
    assert len(tables.select(RECS, mode=["simulate"])) == 2
    assert len(tables.select(RECS, status=["skipped"])) == 1
    assert len(tables.select(RECS, since="2026-12-01")) == 6
    assert len(tables.select(RECS, until="2026-11-30")) == 1
    assert len(tables.select(RECS, until="2026-12-01")) == 7  # a date as `until` covers that whole day
    assert tables.select(RECS, workload=["nope"]) == []


def test_since_and_until_compare_times_as_times():
    """Times were compared as text: a time zone, a space for the T or a record's own offset gave the wrong side."""
    at = {t: rec("fiddler", 1.0, time=t) for t in ("2026-12-01T09:00:00+00:00", "2026-12-01T11:30:00+01:00",
                                                  "2026-12-01T10:00:00", "2026-12-02T00:30:00+02:00")}

    def times(**kw):
        return sorted(r["time"] for r in tables.select(list(at.values()), **kw))

    # 11:00+02:00 is 09:00 UTC: all but the 2 December record, which is 22:30 UTC on 1 December
    assert times(since="2026-12-01T11:00:00+02:00") == sorted(at)
    assert times(since="2026-12-01 09:30") == ["2026-12-01T10:00:00", "2026-12-01T11:30:00+01:00",
                                               "2026-12-02T00:30:00+02:00"]  # naive times are UTC, as records are
    assert times(until="2026-12-01T10:45:00Z") == ["2026-12-01T09:00:00+00:00", "2026-12-01T10:00:00",
                                                   "2026-12-01T11:30:00+01:00"]
    assert times(since="2026-12-01", until="2026-12-01") == sorted(at)  # a date: the whole (UTC) day
    with pytest.raises(ValueError, match="--since 'yesterday' is not an ISO date or time"):
        tables.select(list(at.values()), since="yesterday")


def test_a_bad_since_is_refused_with_exit_2(tmp_path):
    res = run(tmp_path, "--since", "yesterday")
    assert res.returncode == 2 and "--since 'yesterday' is not an ISO date or time" in res.stderr, res.stderr


def test_cli_formats_filters_and_pivot(tmp_path):
    res = run(tmp_path, "--format", "json", "--mode", "execute", "--model", "m")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert sorted((r["system"], r["input"]) for r in rows) == [("deepspeed", 32), ("fiddler", 32), ("fiddler", 64),
                                                               ("llama_cpp", 32)]
    assert all(r["provenance"] == "measured" for r in rows)
    res = run(tmp_path, "--format", "jsonl", "--since", "2026-12-01", "--system", "llama_cpp")
    assert [json.loads(line)["e2e_tok_s"] for line in res.stdout.splitlines()] == [10.0, 2.0]
    res = run(tmp_path, "--format", "csv", "--environment", "e", "--workload", "w", "--model", "other")
    assert res.stdout.splitlines()[0].startswith("system,") and len(res.stdout.splitlines()) == 2
    res = run(tmp_path, "--pivot", "system", "--baseline", "llama_cpp", "--model", "m")
    assert res.returncode == 0, res.stderr
    assert md_table.has_row(res.stdout, "measured", "execute", "32", "skipped", "20.00", "10.00", "2.00x")
    assert md_table.has_row(res.stdout, "simulated", "simulate", "32", "", "8.00", "2.00", "4.00x")
    assert md_table.has_row(res.stdout, "measured", "execute", "64", "", "40.00", "", "")  # no llama_cpp at 64
    assert "model: m · workload: w" in res.stdout  # constant over every row: lifted into the header line
    bad = run(tmp_path, "--baseline", "llama_cpp")
    assert bad.returncode == 2 and "--baseline needs --pivot" in bad.stderr


def test_printed_table_shows_no_plus_minus_for_one_repetition():
    md = tables.to_markdown(tables.build([rec("fiddler", 20.0), rec("llama_cpp", 10.0, reps=3)]))
    rows = {r["system"]: r for r in md_table.dicts(md)}
    assert rows["fiddler"]["e2e tok/s"] == "20.00" and rows["llama_cpp"]["e2e tok/s"] == "10.00 ± 0.10"
