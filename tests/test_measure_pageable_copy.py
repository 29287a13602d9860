"""benchmarks/tools/measure_pageable_copy.py runs on a CPU at tiny dims and writes the JSON its README reads (structure,
not timings: on a CPU there is no pinned memory and the figures mean nothing)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_measure_pageable_copy_cpu(tmp_path):
    out = tmp_path / "copy.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tools" / "measure_pageable_copy.py"), "--device", "cpu",
                        "--tiny", "--reps", "2", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert set(res["ways"]) == {"pinned_copy", "pageable_copy", "release_load_state_dict"}
    assert res["expert"] == {"hidden": 64, "ffn": 128, "bytes": 3 * 64 * 128 * 2}
    assert res["pinned"] is False  # no CUDA: nothing is pinned, and the JSON says so
    for w in res["ways"].values():
        assert w["min_s"] <= w["median_s"] and w["gbps_median"] > 0
    assert "pageable / pinned" in p.stdout
