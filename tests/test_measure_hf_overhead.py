"""benchmarks/tools/measure_hf_layer_overhead.py runs on a CPU at tiny dims and writes the JSON the device check reads.

Structure only, not timings. With FIDDLER_HF436_SITE=<folder holding transformers 4.36.2 and its pins> (e.g.
`pip install --no-deps --target /tmp/site436-cpu transformers==4.36.2 tokenizers==0.15.2 huggingface-hub==0.20.3`,
wheels for this Python) the same run is repeated under 4.36.2, the released Fiddler's pin.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "tools" / "measure_hf_layer_overhead.py"
MODEL_VARIANTS = ("full", "router_only", "no_moe")
RELEASE_VARIANTS = ("fiddler_loop", "fiddler_loop_plan")
SITE_436 = os.environ.get("FIDDLER_HF436_SITE")


def _run(tmp_path: Path, pythonpath: str | None) -> dict:
    out = tmp_path / "hf.json"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--prompt", "8", "--steps", "2", "--reps", "2",
           "--warmup", "1", "--bw-mib", "8", "--out", str(out)]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "router_only" in p.stdout
    return json.loads(out.read_text())


def _check(res: dict, version_prefix: str) -> None:
    import torch

    assert res["transformers"].startswith(version_prefix)
    assert res["torch"] == torch.__version__
    assert res["device"] == "cpu" and res["gpu_name"] is None
    assert res["host_cpu"]["logical_cores"] >= 1 and "model_name" in res["host_cpu"]
    assert res["dims_source"] == "tiny" and res["dims"]["num_hidden_layers"] == 2
    assert res["attn_implementation"] == "eager" and res["attention_class"] == "MixtralAttention"
    assert res["copy_bandwidth_gbps"] > 0
    wb = res["weight_bytes"]
    assert wb["non_expert_per_layer"] == wb["attention_per_layer"] + wb["norms_per_layer"] + wb["gate_per_layer"]
    assert wb["one_expert"] == 3 * 64 * 128 * 2  # w1, w3, w2 of the tiny dims in bf16
    assert set(res["weight_read_ms_at_copy_bandwidth"]) >= {"non_expert_per_layer_plus_kv", "full_layer_1_token"}
    v = res["variants"]
    for name in MODEL_VARIANTS + RELEASE_VARIANTS:
        r = v[name]
        assert r["ok"], r
        for key in ("step_ms", "layers_ms", "per_layer_ms"):
            assert set(r[key]) == {"median", "min"} and 0 < r[key]["min"] <= r[key]["median"]
        assert len(r["rep_step_ms"]) == 2 and len(r["rep_per_layer_ms"]) == 2
        # the decoder layers are part of the step
        assert r["layers_ms"]["min"] <= max(r["rep_step_ms"])
    for name in ("router_only_sdpa", "full_eager_experts"):
        assert v[name]["ok"] or "skipped" in v[name], v[name]
    assert set(res["derived_medians"]) == {"router_per_layer_ms", "experts_per_layer_ms", "plan_per_layer_ms",
                                           "model_forward_vs_release_loop_per_layer_ms"}


@pytest.mark.slow  # about 20 s on a 2-core VM, most of it importing transformers
def test_measure_hf_overhead_cpu_installed_transformers(tmp_path):
    pytest.importorskip("transformers")
    res = _run(tmp_path, None)
    import transformers

    _check(res, transformers.__version__)
    if int(transformers.__version__.split(".")[0]) >= 5:  # these switch at runtime there
        assert res["variants"]["router_only_sdpa"]["ok"]
        assert res["variants"]["router_only_sdpa"]["attn_implementation"] == "sdpa"
        assert res["variants"]["full_eager_experts"]["experts_implementation"] == "eager"


@pytest.mark.slow
@pytest.mark.skipif(not SITE_436, reason="FIDDLER_HF436_SITE not set (a folder with transformers 4.36.2)")
def test_measure_hf_overhead_cpu_transformers_436(tmp_path):
    res = _run(tmp_path, SITE_436)
    _check(res, "4.36.2")
    assert res["moe_returns_tuple"] is True  # 4.36.2's decoder layer unpacks (hidden, router_logits)
    assert res["gate_class"] == "Linear"
    assert "skipped" in res["variants"]["router_only_sdpa"]  # 4.36.2's Mixtral has no SDPA attention
