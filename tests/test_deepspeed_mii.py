"""DeepSpeed baselines (system=deepspeed_mii): option handling, the missing-extra path, and, with the
`mii` extra installed, both engines for real on this machine.

The engines run in a child process (this file run as a script): DeepSpeed makes a process group,
fixes its accelerator for the life of the process and switches transformers into ZeRO-3 loading
mode, none of which may leak into other tests. The first run on a machine also JIT-builds
DeepSpeed's shared-memory comm op (~2 min on 2 cores, cached in ~/.cache/torch_extensions).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from systems.base import GenerationRequest, ModelSpec, RunContext, SystemUnavailable
from systems.deepspeed_mii.config import DeepSpeedConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTALL = 'pip install -e ".[mii]"'


def _ctx(tmp) -> RunContext:
    return RunContext(threads=2, gpu_memory_gb=0.0, has_cuda=False, cache_dir=str(tmp))


def _tiny() -> pathlib.Path:
    from runners.models import synthetic_model

    return synthetic_model("tiny_mixtral")


# ----------------------------------------------------------------------------- no deepspeed needed
def test_zero_inference_config_is_the_authors_recipe():
    from systems.deepspeed_mii.zero_inference import zero_inference_config

    cfg = zero_inference_config("bfloat16")
    assert cfg["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    assert cfg["bf16"] == {"enabled": True} and cfg["train_micro_batch_size_per_gpu"] == 1
    cfg = zero_inference_config("float32", "nvme", False, "/x", {"stage3_param_persistence_threshold": 0})
    assert cfg["bf16"] == {"enabled": False}
    assert cfg["zero_optimization"]["offload_param"] == {"device": "nvme", "pin_memory": False, "nvme_path": "/x"}
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    for bad in (dict(offload_device="gpu"), dict(overrides={"stage": 2}), dict(offload_device="nvme")):
        with pytest.raises(ValueError):
            zero_inference_config("float32", **bad)


def test_option_validation(tmp_path):
    from systems.deepspeed_mii.adapter import DeepSpeedAdapter

    from systems.deepspeed_mii.config import DeepSpeedEngine, OffloadDevice

    spec = ModelSpec("m", str(tmp_path))
    with pytest.raises(ValueError, match="engine"):
        DeepSpeedConfig.build(engine="fastgen")
    with pytest.raises(ValueError, match="offload_device"):
        DeepSpeedConfig.build(offload_device="gpu")
    with pytest.raises(ValueError, match="tensor_parallel"):
        DeepSpeedConfig.build(tensor_parallel=2)
    ad = DeepSpeedAdapter(DeepSpeedConfig.build(name="deepspeed_mii", adapter="x:y"), spec, _ctx(tmp_path))
    assert ad.info()["engine"] == "zero_offload" and ad.info()["install"] == INSTALL
    ad = DeepSpeedAdapter(DeepSpeedConfig.build(engine="mii", offload_device="nvme"), spec, _ctx(tmp_path))
    assert ad.config.engine is DeepSpeedEngine.mii and ad.config.offload_device is OffloadDevice.nvme
    assert ad.info()["options"]["engine"] == "mii"


@pytest.mark.parametrize("engine", ["zero_offload", "mii"])
def test_missing_extra_names_the_install_command(engine, tmp_path, monkeypatch):
    from systems.deepspeed_mii.adapter import DeepSpeedAdapter

    # None in sys.modules makes `import deepspeed` / `import mii` raise ImportError, as when not installed
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "mii", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # keep load() from touching the real environment
    ad = DeepSpeedAdapter(DeepSpeedConfig.build(engine=engine), ModelSpec("m", str(tmp_path), "bfloat16"), _ctx(tmp_path))
    with pytest.raises(SystemUnavailable, match=r"'mii' extra.*" + re.escape(INSTALL)):
        ad.load()


# ----------------------------------------------------------------------------- with the extra installed
@pytest.fixture(scope="module")
def child_report(tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("mii")
    model = _tiny()
    work = tmp_path_factory.mktemp("ds")
    proc = subprocess.run([sys.executable, "-m", "tests.test_deepspeed_mii", str(model), str(work)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_mii_engine_reports_deepspeeds_reason(child_report):
    mii = child_report["mii"]
    if mii["status"] == "ok":  # a CUDA machine: FastGen ran and matched transformers
        assert mii["tokens"] == child_report["reference"]["greedy"]
        return
    assert mii["status"] == "unavailable", mii
    # the exception text comes from DeepSpeed/torch, e.g. "RuntimeError: Distributed package doesn't have NCCL built in"
    assert "mii.pipeline raised" in mii["reason"] and "Error" in mii["reason"], mii["reason"]


def test_zero_offload_matches_transformers(child_report):
    z = child_report["zero_offload"]
    if z["status"] == "unavailable":
        pytest.skip(z["reason"])
    assert z["status"] == "ok", z
    ref = child_report["reference"]
    assert len(z["greedy"]) == child_report["n"]
    assert z["greedy"] == ref["greedy"]
    assert z["beam"] == ref["beam"]
    assert z["first_token_calls"] == [1, 1]
    info = z["info"]
    assert info["engine"] == "zero_offload" and info["zero_config"]["zero_optimization"]["stage"] == 3
    assert info["versions"]["deepspeed"] and info["versions"]["deepspeed-mii"]
    if not child_report["cuda"]:
        assert info["accelerator"] == "cpu" and info["paper_setup"] is False and "NOT the paper" in info["note"]
    # close() leaves transformers out of ZeRO-3 mode and the process usable
    assert z["zero3_after_close"] is False
    assert z["reload_greedy"] == ref["greedy"]


# ----------------------------------------------------------------------------- the child process
def _child(model: str, work: str) -> None:
    import torch

    from systems.deepspeed_mii.adapter import DeepSpeedAdapter

    cuda = torch.cuda.is_available()
    ctx = RunContext(threads=2, gpu_memory_gb=0.0, has_cuda=cuda, cache_dir=work)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 1024, (20,), generator=g).tolist()
    n = 12
    out: dict = {"n": n, "cuda": cuda}

    def run(adapter) -> dict:
        calls, res = [], {}
        for key, beams in (("greedy", 1), ("beam", 2)):
            fired = []
            res[key] = adapter.generate(GenerationRequest(prompt, n, beam_width=beams), lambda: fired.append(1)).tokens
            calls.append(len(fired))
        res["first_token_calls"] = calls
        return res

    # the reference: plain transformers generate with the hf_transformers adapter's arguments
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out["reference"] = {}
    for key, beams in (("greedy", 1), ("beam", 2)):
        with torch.no_grad():
            seq = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, num_beams=beams, early_stopping=False, pad_token_id=0)
        out["reference"][key] = seq[0, ids.shape[1]:].tolist()
    del ref

    for engine, dtype in (("mii", "bfloat16"), ("zero_offload", "float32")):
        ad = DeepSpeedAdapter(DeepSpeedConfig.build(engine=engine), ModelSpec("tiny", model, dtype), ctx)
        try:
            ad.load()
        except SystemUnavailable as exc:
            out[engine] = {"status": "unavailable", "reason": str(exc)}
            continue
        if engine == "mii":
            fired = []
            out[engine] = {"status": "ok", "tokens": ad.generate(GenerationRequest(prompt, n), lambda: fired.append(1)).tokens}
        else:
            out[engine] = {"status": "ok", **run(ad), "info": ad.info()}
        ad.close()

    if out["zero_offload"]["status"] == "ok":
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        out["zero_offload"]["zero3_after_close"] = bool(is_deepspeed_zero3_enabled())
        again = DeepSpeedAdapter(DeepSpeedConfig.build(engine="zero_offload"), ModelSpec("tiny", model, "float32"), ctx)
        again.load()  # a second load in the same process reuses the process group
        out["zero_offload"]["reload_greedy"] = again.generate(GenerationRequest(prompt, n), lambda: None).tokens
        again.close()
    print("RESULT " + json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _child(sys.argv[1], sys.argv[2])
