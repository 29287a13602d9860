"""The one text-table path (runners/table_format.py): constant columns lifted into a header line, fixed
precision per column, numbers right-aligned, ± only with repetitions, and the machine formats."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from runners import table_format as tf
from runners.table_format import Col
from tests import md_table


def frame():
    return pd.DataFrame([
        {"system": "a", "env": "e1", "tok": 21.7, "tok_sd": 0.5, "reps": 3, "empty": None},
        {"system": "b", "env": "e1", "tok": 22.0, "tok_sd": 0.25, "reps": 1, "empty": None},
    ])


COLS = [Col("system", "system"), Col("env", "environment"), Col("tok", "tok/s", 2, sd="tok_sd"),
        Col("empty", "never set", 1), Col("reps", "reps", 0)]


def test_constant_columns_go_to_a_header_line_and_empty_ones_are_dropped():
    md = tf.render(frame(), COLS, head=["Numbers: x"], reps="reps")
    assert md.split("\n\n")[0] == "Numbers: x"
    assert md.split("\n\n")[1] == "environment: e1"
    (table,) = md_table.tables(md)
    assert table[0] == ["system", "tok/s", "reps"]  # environment lifted, the empty column gone
    # ± only where the row has more than one repetition; fixed precision for the whole column
    assert table[1:] == [["a", "21.70 ± 0.50", "3"], ["b", "22.00", "1"]]


def test_numbers_are_right_aligned_and_text_left_aligned_with_padded_cells():
    md = tf.render(frame(), COLS, reps="reps", lift=False)
    lines = [line for line in md.splitlines() if line.startswith("|")]
    assert len({len(line) for line in lines}) == 1  # every line padded to the same widths
    rule = lines[1].strip("|").split("|")
    assert rule[0].endswith("-") and rule[2].endswith(":")  # system left, tok/s right
    raw = lines[3].split("|")  # row b: "22.00" under the wider "21.70 ± 0.50"
    assert raw[3] == " " + "22.00".rjust(len("21.70 ± 0.50")) + " "
    assert raw[1] == " " + "b".ljust(len("system")) + " "


def test_a_single_row_keeps_every_column_and_lift_false_keeps_constant_ones():
    one = tf.render(frame().iloc[:1], COLS, reps="reps")
    assert md_table.tables(one)[0][0] == ["system", "environment", "tok/s", "reps"]
    both = tf.render(frame(), COLS, reps="reps", lift=False)
    assert "environment" in md_table.tables(both)[0][0]
    assert tf.render(frame(), [Col("env", "environment")]) == "environment: e1"  # all lifted: the line says it


def test_fixed_precision_keeps_small_nonzero_values_and_text_passes_through():
    assert tf.number(0.0004, 2) == "0.0004"
    assert tf.number(0.0, 2) == "0.00"
    assert tf.number(1.0, 2, "x") == "1.00x"
    assert tf.number("skipped", 2) == "skipped"
    assert tf.number(None, 2) == "" and tf.number(float("nan"), 2) == ""
    assert tf.number(0.0123, 1, scale=1000) == "12.3"


def test_auto_digits_gives_each_column_one_precision():
    assert tf.auto_digits([21.7, 22.0]) == 1  # "21.7" beside "22.0", not "22"
    assert tf.auto_digits([1.0, 0.93, 1.04]) == 2  # a ratio as "1.00", not "1"
    assert tf.auto_digits([3, 4]) == 0
    assert tf.auto_digits(["a", 1.0]) is None
    assert tf.auto_digits([0.0123, 0.05]) == 4
    md = tf.records([{"ratio": 1.0, "ok": True}, {"ratio": 0.934, "ok": False}])
    assert md_table.tables(md)[0][1:] == [["1.00", "yes"], ["0.93", "**no**"]]


def test_machine_formats_keep_every_column_and_raw_values():
    df = frame()
    rows = json.loads(tf.render(df, COLS, fmt="json"))
    assert rows[0] == {"system": "a", "env": "e1", "tok": 21.7, "empty": None, "reps": 3}
    lines = tf.render(df, COLS, fmt="jsonl").splitlines()
    assert [json.loads(line)["system"] for line in lines] == ["a", "b"]
    csv = tf.render(df, COLS, fmt="csv").splitlines()
    assert csv[0] == "system,env,tok,empty,reps" and csv[1].startswith("a,e1,21.7,")
    with pytest.raises(ValueError, match="unknown table format"):
        tf.render(df, COLS, fmt="xml")


def test_pipes_in_cells_are_escaped():
    md = tf.render(pd.DataFrame([{"a": "x|y"}]), [Col("a", "a")])
    assert "x\\|y" in md
