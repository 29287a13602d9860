"""`python run.py --help`: every group option conf/ has, the modes, the experiments and the exit codes; no
`*_schema` structured config offered as a choice."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from runners import cli_help
from runners.schema import Mode
from systems.registry import system_classes

ROOT = Path(__file__).resolve().parents[1]


def test_run_py_help_lists_the_choices_and_no_schema():
    res = subprocess.run([sys.executable, "run.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "_schema" not in out
    lines = [line.split() for line in out.splitlines()]
    firsts = {parts[0] for parts in lines if parts}
    for group in (*cli_help.GROUPS, "experiment"):
        for yaml in (ROOT / "conf" / group).glob("*.yaml"):
            assert yaml.stem in firsts, f"{group}={yaml.stem} missing from --help"
    for name in system_classes():  # systems are config classes, not yaml files
        assert name in firsts, f"system={name} missing from --help"
    assert {m.value for m in Mode} <= firsts  # every mode the schema accepts
    assert {"0", "1", "2"} <= firsts and "== exit status ==" in out
    assert "-m +experiment=" in out


def test_a_new_option_appears_with_the_first_sentence_of_its_comment(tmp_path):
    for group in (*cli_help.GROUPS, "experiment"):
        (tmp_path / group).mkdir()
    (tmp_path / "model" / "toy.yaml").write_text("# A toy model. More words here\n# and here.\nname: toy\n")
    (tmp_path / "experiment" / "toy_exp.yaml").write_text("# @package _global_\n# Costs $5: a toy.\n")
    text = cli_help.text(tmp_path)
    assert "  toy" in text and "A toy model." in text and "More words" not in text
    assert "  fiddler_original" in text and "The released Fiddler as the paper ran it" in text  # a class's docstring
    assert "Costs $$5: a toy." in text  # doubled for Hydra's string.Template, which prints it once


def test_a_period_inside_parentheses_does_not_end_the_sentence():
    words = "Beam search (the paper's Fig. 6 setting): widths 4..16. Then more.".split()
    assert cli_help._first_sentence(words) == "Beam search (the paper's Fig. 6 setting): widths 4..16."
    assert cli_help._first_sentence("One. Two.".split()) == "One."
