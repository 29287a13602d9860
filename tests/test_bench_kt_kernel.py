"""scripts/bench_kt_kernel.py: kTransformers' kernel beside ours. kt-kernel lives in its own virtual
environment (see the script), so here only what runs without it: the refusal, with the reason, where it
does not import, and the comparison's arithmetic."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_kt_kernel.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_kt_kernel", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_kt_kernel_it_says_why_and_measures_nothing():
    if importlib.util.find_spec("kt_kernel") is not None:
        pytest.skip("kt-kernel is importable here")
    import fiddler.kernels as fk

    if not fk.is_available():
        pytest.skip(f"kernel library not available: {fk.load_error()}")
    r = subprocess.run([sys.executable, str(SCRIPT), "--hidden", "64", "--ffn", "128", "--copies", "2", "--tokens", "1",
                        "--rounds", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "kt-kernel does not import here: ModuleNotFoundError" in r.stderr
    assert "tokens" not in r.stdout  # no row was measured


def test_relative_error_is_against_the_reference_scale():
    mod = load()
    ref = torch.tensor([[2.0, -4.0]])
    assert mod.rel_err(ref, ref) == 0.0
    assert mod.rel_err(torch.tensor([[2.0, -3.0]]), ref) == pytest.approx(0.25)
