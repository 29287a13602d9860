"""runners/decode_bound.py: the bytes a decode step reads over the host's read limit."""
from __future__ import annotations

import pytest
import torch

from fiddler.config import MoEConfig
from runners.decode_bound import decode_bound
from tests.models import model_path

LIMIT = {"gbps": 20.0, "best": "read_t0_2t", "strategies": {"read_t0_2t": 20.0, "gemv_fp32_2t": 15.0}}


def test_bound_counts_the_bytes_of_every_decode_step():
    path = model_path("e16k4_odd")
    cfg = MoEConfig.from_pretrained(path)
    b = decode_bound(str(path), "bfloat16", 9, 5, 1, {"mean": 100.0, "best": 120.0}, None, LIMIT)
    steps = [cfg.decode_bytes_per_token(kv, torch.bfloat16) for kv in range(10, 14)]  # KV grows 10..13
    assert b["bytes_per_token"] == pytest.approx(sum(steps) / 4)
    assert b["bound_tok_s"] == pytest.approx(20e9 / b["bytes_per_token"])
    assert b["fraction"]["best"] == pytest.approx(120.0 / b["bound_tok_s"])
    assert b["limit_by"] == "read_t0_2t" and b["limit_strategies"] == LIMIT["strategies"]
    assert b["experts_per_layer"] == cfg.top_k


def test_beams_count_the_experts_they_used():
    path = model_path("e16k4_odd")
    cfg = MoEConfig.from_pretrained(path)
    shared = decode_bound(str(path), "bfloat16", 9, 5, 3, {"mean": 1.0, "best": 1.0}, 6.5, limit=LIMIT)
    assert shared["experts_per_layer"] == 6.5
    assert shared["bytes_per_token"] == pytest.approx(
        sum(cfg.decode_bytes_per_token(kv, torch.bfloat16, 3, 6.5) for kv in range(10, 14)) / 4)
    worst = decode_bound(str(path), "bfloat16", 9, 5, 3, {"mean": 1.0, "best": 1.0}, None, LIMIT)
    assert worst["experts_per_layer"] == min(3 * cfg.top_k, cfg.num_experts)
    assert decode_bound(str(path), "bfloat16", 9, 1, 1, {"mean": None, "best": None}, None, LIMIT) is None
    assert decode_bound(str(path), "bfloat16", 9, 5, 1, {"mean": 1.0}, None, None) is None  # no limit known


def test_the_limit_is_the_environments_with_the_strategies_of_this_runs_measurement(monkeypatch):
    from runners import decode_bound as db

    measured = {"gbps": 31.27, "best": "read_t0_2t", "strategies": {"read_t0_2t": 31.27}}
    monkeypatch.setattr(db.hardware, "known_read_limit", lambda: measured)
    assert db.environment_limit(31.3) == measured  # environment=local: the value it reported, named
    own = db.environment_limit(80.0)  # described or overridden: the configured value, said so
    assert own["gbps"] == 80.0 and own["strategies"] == {} and "as configured" in own["best"]
    assert db.environment_limit(0.0) is None
    monkeypatch.setattr(db.hardware, "known_read_limit", lambda: None)
    assert db.environment_limit(31.3)["strategies"] == {}


def test_a_measured_limit_reaches_child_processes(monkeypatch):
    """A sweep's children state the parent's measurement instead of measuring again."""
    import json
    import subprocess
    import sys

    measured = {"gbps": 12.5, "best": "gemv_fp32_2t", "strategies": {"gemv_fp32_2t": 12.5}, "threads": 2}
    monkeypatch.setenv("FIDDLER_READ_LIMIT", json.dumps(measured))
    out = subprocess.run([sys.executable, "-c", "import json; from runners import hardware; "
                          "print(json.dumps(hardware.known_read_limit()))"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == measured
