"""The device check's driver (scripts/device_check/driver.py): its file checker, its arithmetic, the stress test's
power to see a wrong copy, and real sections on this machine (emulated GPU). The whole dry run is a step of
.ci/run (scripts/device_check.sh --dry-run), which ends with the same checker."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dc():
    """The driver (it puts its folder on sys.path, so its dc_* modules import as they do when run)."""
    spec = importlib.util.spec_from_file_location("device_check_driver", ROOT / "scripts/device_check/driver.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def parts(dc):
    import dc_common
    import dc_gpu
    import dc_offload

    return dc_common, dc_gpu, dc_offload


def write_complete(dc, out: pathlib.Path) -> None:
    for name, _fn, _t, fields in dc.SECTIONS:
        dc.write(out, name, {"section": name, "status": "ok", "mode": "test", "seconds": 1.0,
                             **{f: {"x": 1} for f in fields}})


def test_check_accepts_a_complete_run_and_names_each_gap(dc, tmp_path):
    write_complete(dc, tmp_path)
    assert dc.check(tmp_path) == []

    p = dc.file_of(tmp_path, "offload")
    d = json.loads(p.read_text())
    del d["makespan"]
    p.write_text(json.dumps(d))
    dc.file_of(tmp_path, "threads").unlink()
    dc.record_stop(dc.Ctx(tmp_path, True, tmp_path), "h2d", "timeout", "")  # exists: record_stop keeps it
    q = dc.file_of(tmp_path, "hf_offload")
    q.write_text(json.dumps({"section": "hf_offload", "status": "skipped", "mode": "m", "seconds": 0}))
    r = dc.file_of(tmp_path, "races")
    r.write_text(json.dumps({**json.loads(r.read_text()), "sanitizer": {"skipped": " "}}))
    problems = dc.check(tmp_path)
    assert any("04_offload.json: missing ['makespan']" in p for p in problems)
    assert any("07_threads.json: missing" in p for p in problems)
    assert any("06_hf_offload.json: status skipped without a reason" in p for p in problems)
    assert any("02_races.json: .sanitizer is skipped without a reason" in p for p in problems)
    assert len(problems) == 4


def test_a_section_that_stops_or_raises_says_why(dc, tmp_path, monkeypatch):
    ctx = dc.Ctx(tmp_path, True, tmp_path)
    dc.record_stop(ctx, "threads", "timeout", "stopped after 60 s")
    d = json.loads(dc.file_of(tmp_path, "threads").read_text())
    assert d["status"] == "timeout" and d["reason"] == "stopped after 60 s"

    def broken(ctx):
        raise RuntimeError("no such device")

    monkeypatch.setattr(dc, "SECTIONS", [(n, broken if n == "h2d" else f, t, fl) for n, f, t, fl in dc.SECTIONS])
    assert dc.run_section(ctx, "h2d") == 1
    d = json.loads(dc.file_of(tmp_path, "h2d").read_text())
    assert d["status"] == "failed" and "RuntimeError: no such device" in d["reason"] and "traceback" in d


def test_overlap_and_link_arithmetic(parts):
    common, _gpu, offload = parts
    o = offload.overlap([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], [(2.5, 5.5)])
    assert o["a_s"] == pytest.approx(4.0) and o["b_s"] == pytest.approx(3.0)
    assert o["both_s"] == pytest.approx(1.0) and o["fraction"] == pytest.approx(1 / 3)
    assert offload.overlap([], [(0.0, 1.0)])["fraction"] is None
    assert common.pcie_link_gbps(4, 16) == pytest.approx(31.5, rel=1e-3)
    assert common.pcie_link_gbps(5, 16) == pytest.approx(63.0, rel=1e-3)
    assert common.pcie_link_gbps(2, 8) == pytest.approx(4.0)


def test_stress_sees_a_copy_that_did_not_land(dc, parts, tmp_path, monkeypatch):
    """The stress compares kind b with kind a bit for bit: a copy that leaves a buffer stale (what a missing
    wait between the streams does on a GPU) must show, and the honest executor must pass."""
    from fiddler.executors.copy_in import CopyIn

    ctx = dc.Ctx(tmp_path, True, tmp_path)
    stress = parts[1].stress_copy_buffers
    good = stress(ctx, torch.float32, delay_s=0.0, layers=2, seeds=1)
    assert good["b_equals_a_bitwise"] and good["c_within_tolerance"]
    assert good["copies_per_layer_call"] > good["copy_buffers"]  # each buffer is reused within a layer

    real = CopyIn.copy
    calls = []

    def sometimes_stale(self, slot, dsts, srcs):
        calls.append(slot)
        if len(calls) % 3 == 0:
            return None  # the compute reads what the buffer held before
        return real(self, slot, dsts, srcs)

    monkeypatch.setattr(CopyIn, "copy", sometimes_stale)
    bad = stress(ctx, torch.float32, delay_s=0.0, layers=2, seeds=1)
    assert not bad["b_equals_a_bitwise"] and bad["max_abs_b_minus_a"] > 0


def test_real_sections_on_the_emulated_gpu_write_their_fields(dc, tmp_path):
    ctx = dc.Ctx(tmp_path, True, tmp_path / "cache")
    for name in ("env", "h2d", "llama_gpu"):
        assert dc.run_section(ctx, name) == 0
    problems = [p for p in dc.check(tmp_path) if p.split(":")[0] in {"01_env.json", "03_h2d.json", "08_llama_gpu.json"}]
    assert problems == []
    h2d = json.loads(dc.file_of(tmp_path, "h2d").read_text())
    assert h2d["alone"]["pinned_gbps"] > 0 and h2d["cpu_kernel"]["read_limit_gbps"] > 0
    assert "skipped" in h2d["fraction_of_link"]  # no link to be a fraction of, and it says so
    gpu = json.loads(dc.file_of(tmp_path, "llama_gpu").read_text())
    assert gpu["status"] == "skipped" and "no CUDA" in gpu["reason"]
