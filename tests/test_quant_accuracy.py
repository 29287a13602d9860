"""scripts/quant_accuracy.py's arithmetic on hand-made logits (the measurement itself needs the generated
models and llama.cpp: results/measured/*quant*)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "quant_accuracy.py"


def load():
    spec = importlib.util.spec_from_file_location("quant_accuracy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_counts_agreement_without_ties_and_kl_of_the_reference():
    mod = load()
    ref = [torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])]  # last row: a tie
    other = [torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), torch.tensor([[0.0, 3.0, 0.0]])]
    r = mod.compare(ref, other)
    assert r["positions"] == 3 and r["ties_excluded"] == 1
    assert r["top1_agreement"] == pytest.approx(0.5)
    p, q = torch.tensor([0.0, 1.0, 0.0]).softmax(-1), torch.tensor([1.0, 0.0, 0.0]).softmax(-1)
    kl_row2 = float((p * (p / q).log()).sum())  # KL(p_ref || p_other), not the reverse
    p3, q3 = torch.tensor([1.0, 1.0, 0.0]).softmax(-1), torch.tensor([0.0, 3.0, 0.0]).softmax(-1)
    kl_row3 = float((p3 * (p3 / q3).log()).sum())
    assert r["kl_mean"] == pytest.approx((0 + kl_row2 + kl_row3) / 3, rel=1e-5)
    assert r["kl_max"] == pytest.approx(max(kl_row2, kl_row3), rel=1e-5)


def row(agree, kl, positions=500, ties=0):
    return {"top1_agreement": agree, "kl_mean": kl, "positions": positions, "ties_excluded": ties}


def test_no_worse_needs_both_agreement_and_kl():
    mod = load()
    assert mod.no_worse(row(0.90, 1e-3), row(0.90, 1e-3))["verdict"] == "met"  # equal is no worse
    assert mod.no_worse(row(0.91, 1e-3), row(0.90, 2e-3))["verdict"] == "met"
    assert mod.no_worse(row(0.89, 1e-3), row(0.90, 2e-3))["verdict"] == "not met (top-1 agreement lower)"
    assert mod.no_worse(row(0.91, 3e-3), row(0.90, 2e-3))["verdict"] == "not met (mean KL higher)"
    assert mod.no_worse(row(0.8, 3e-3), row(0.9, 2e-3))["verdict"] == ("not met (top-1 agreement lower, "
                                                                        "mean KL higher)")


def test_no_worse_reports_the_gap_and_its_standard_error():
    mod = load()
    r = mod.no_worse(row(0.80, 2e-3, positions=410, ties=10), row(0.90, 4e-3, positions=400))
    assert r["top1_gap_pp"] == pytest.approx(-10.0)
    assert r["top1_gap_se_pp"] == pytest.approx(100 * math.sqrt(0.8 * 0.2 / 400 + 0.9 * 0.1 / 400))
    assert r["kl_ratio"] == pytest.approx(0.5)
    md = mod._fair_markdown([{"model": "m", "quant": "q4_0", "reference": "transformers", **r}])
    assert "| m | q4_0 | transformers | -10.0 ± 2.5 pp | 0.50 | not met (top-1 agreement lower) |" in md
    assert mod._fair_markdown([]) == ""
