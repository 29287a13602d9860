"""Figures (runners/figures.py, scripts/plot.py and the paper figures of runners/paper.py) on hand-made records:
what is drawn (series, gaps, axes), that simulated and measured points are never joined, the three formats at
200 dpi, and byte-identical files for the same records."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runners import figures, paper, tables
from tests.test_paper_tables import REPORTED, rec as paper_rec, single_batch_records
from tests.test_tables_cli import rec

ROOT = Path(__file__).resolve().parents[1]

SWEEP = [rec("fiddler", 10.0 * i, input_len=32 * i) for i in (1, 2, 4)] + \
    [rec("llama_cpp", 5.0 * i, input_len=32 * i) for i in (1, 4)] + \
    [rec("fiddler", 3.0, input_len=32, mode="simulate"), rec("fiddler", 4.0, input_len=64, mode="simulate")] + \
    [rec("deepspeed", None, input_len=32, status="skipped")]


def test_series_keep_simulated_and_measured_apart_and_missing_points_absent():
    varying, panels = figures.sweep_series(tables.build(SWEEP), "input_len", "e2e_tok_s")
    assert varying == ["mode"]  # execute and simulate records: one panel each, never one line
    lines = {k: v for panel in panels.values() for k, v in panel.items()}
    assert lines["fiddler (measured)"] == [(32, 10.0), (64, 20.0), (128, 40.0)]
    assert lines["fiddler (simulated)"] == [(32, 3.0), (64, 4.0)]
    assert lines["llama_cpp (measured)"] == [(32, 5.0), (128, 20.0)]  # 64 missing: absent, not zero
    assert not any(k.startswith("deepspeed") for k in lines)  # skipped: no point
    with pytest.raises(ValueError, match="no column 'nope'"):
        figures.sweep_series(tables.build(SWEEP), "nope", "e2e_tok_s")


def test_value_axis_is_linear_below_a_10x_span_and_log_above():
    plt = figures.pyplot()
    f, (a, b) = plt.subplots(1, 2)
    figures.set_value_axis(a, [1.0, 9.0])
    figures.set_value_axis(b, [0.27, 3.7])
    assert a.get_yscale() == "linear" and a.get_ylim()[0] == 0
    assert b.get_yscale() == "log"
    plt.close(f)
    assert figures.span([0.27, None, float("nan"), 3.7]) == pytest.approx(3.7 / 0.27)


def test_plot_cli_writes_png_pdf_svg_at_200_dpi_and_refuses_bad_input(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SWEEP))
    res = subprocess.run([sys.executable, "scripts/plot.py", str(path), "--x", "input_len", "--y", "e2e_tok_s",
                          "--where", "mode=execute", "--out", str(tmp_path / "p")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(tmp_path / f"p.{ext}") for ext in ("png", "pdf", "svg")]
    from PIL import Image

    with Image.open(tmp_path / "p.png") as im:
        assert round(im.info["dpi"][0]) == 200
    assert (tmp_path / "p.pdf").read_bytes().startswith(b"%PDF") and b"<svg" in (tmp_path / "p.svg").read_bytes()
    bad = subprocess.run([sys.executable, "scripts/plot.py", str(path), "--x", "input_len", "--y", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no column 'nope'" in bad.stderr
    bad = subprocess.run([sys.executable, "scripts/plot.py", str(path), "--x", "input", "--y", "e2e_tok_s",
                          "--where", "mode"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


def test_paper_figures_are_byte_identical_in_every_format_and_carry_no_stamp(tmp_path):
    df = paper.frame(single_batch_records())
    for name, records in (("a", single_batch_records()), ("b", list(reversed(single_batch_records())))):
        paper.plot_figure(paper.frame(records), paper.FIGURES["single_batch"], tmp_path / name, REPORTED)
    for ext in figures.FORMATS:
        a, b = (tmp_path / f"a.{ext}").read_bytes(), (tmp_path / f"b.{ext}").read_bytes()
        assert a == b, ext
        stamps = {"png": [b"matplotlib"], "pdf": [b"CreationDate", b"Matplotlib"], "svg": [b"<dc:date>", b"Matplotlib v"]}
        assert not [s for s in stamps[ext] if s in a], ext  # no date, no software version
    assert paper.plot_parity(df, REPORTED, tmp_path / "parity")  # written: the Fig. 4 cell has reported values


def test_parity_points_are_every_value_the_paper_reports():
    df = paper.frame(single_batch_records())
    pts = paper.parity_points(df, REPORTED)
    cells = pts[pts["kind"] == "cell"]
    assert len(cells) == 8 and len(pts[pts["kind"] == "summary"]) == 3  # Fig. 4's 8 values, the 3 headlines
    f = cells[(cells["environment"] == "paper_env1") & (cells["system"] == "fiddler_original")].iloc[0]
    assert (f["paper"], f["ours"]) == (2.53, 2.4)
    # paper_env2 has no records here: its cells are there, without our value (drawn as "not simulated")
    assert cells[cells["environment"] == "paper_env2"]["ours"].isna().all()


def test_missing_cells_are_named_in_the_panel_title_with_their_status():
    assert figures.titled("env", {}, 4) == "env"
    t = figures.titled("env", {"Fiddler": 4, "llama.cpp": 1}, 4, {"Fiddler": "skipped"})
    assert t == "env\nnot shown: Fiddler (all skipped); llama.cpp (1 of 4 missing)"


def test_budget_ablation_marks_the_cards_real_memory(tmp_path, monkeypatch):
    import pandas as pd

    frame = pd.DataFrame([{"environment": "rtx4090", "memory_gb": gb, "status": "ok", "e2e_tok_s": 2 + gb / 10,
                           "card_memory_gb": 24.0, "provenance": "simulated"} for gb in (0, 24, 48)])
    drawn = []
    monkeypatch.setattr(figures, "save", lambda fig, stem, formats=figures.FORMATS: drawn.append(fig) or [stem])
    assert paper.plot_budget(frame, "GPU budget", tmp_path / "budget") == [tmp_path / "budget"]
    (ax,) = drawn[0].axes
    vertical = [line for line in ax.get_lines() if list(line.get_xdata()) == [24.0, 24.0]]
    assert len(vertical) == 1  # the card's real memory
    assert any("rtx4090's real 24 GB" in t.get_text() for t in ax.texts)
    assert ax.get_yscale() == "linear"  # 2.0 to 6.8 tok/s: under a 10x span
    assert "SIMULATED" in ax.get_title()
