"""llama.cpp's GPU layers under a budget (`-ngl` as large as fits, and the `--n-cpu-moe` alternative):
the arithmetic that execute mode on CUDA and the simulator's llama.cpp policy share. No CUDA needed."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from systems.base import ModelSpec, RunContext
from systems.llama_cpp.config import LlamaCppConfig
from systems.llama_cpp.layers import OVERHEAD_BYTES, cpu_moe_layers, gpu_layers, layer_parts
from fiddler.config import MoEConfig

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


@pytest.fixture(scope="module")
def mixtral() -> MoEConfig:
    arch = yaml.safe_load((ROOT / "conf" / "model" / "mixtral_8x7b.yaml").read_text())["arch"]
    return MoEConfig.from_dict({"model_type": "mixtral", **arch})


def test_mixtral_8x7b_layer_sizes(mixtral):
    parts = layer_parts(mixtral, "bf16", n_ctx=4096)
    assert parts["experts"] == 8 * 3 * 4096 * 14336 * 2  # 2.82 GB of experts per layer
    assert parts["rest"] == (4096 * 128 * (2 * 32 + 2 * 8) + 8 * 4096 + 2 * 4096) * 2 + 2 * 8 * 128 * 4096 * 2
    assert parts["output"] == 32001 * 4096 * 2
    assert layer_parts(mixtral, "q8_0")["experts"] == pytest.approx(parts["experts"] * 8.5 / 16, rel=1e-9)


@pytest.mark.parametrize("budget_gb, layers", [(12, 4), (24, 8), (48, 17)])
def test_whole_layers_that_fit_the_papers_cards(mixtral, budget_gb, layers):
    """RTX 3060, RTX 4090/Quadro RTX 6000, RTX 6000 Ada: bf16 Mixtral-8x7B layers are 2.92 GB each."""
    fit = gpu_layers(mixtral, budget_gb * GiB)
    assert (fit.n_gpu_layers, fit.gpu_layers, fit.output_on_gpu, fit.n_cpu_moe) == (layers, layers, False, 0)
    per_layer = sum(v for k, v in layer_parts(mixtral).items() if k != "output")
    assert fit.gpu_bytes <= fit.budget_bytes < fit.gpu_bytes + per_layer  # fits; one more would not


@pytest.mark.parametrize("budget", [0, OVERHEAD_BYTES, OVERHEAD_BYTES + 10**9])
def test_nothing_on_the_gpu_when_no_layer_fits(mixtral, budget):
    fit = gpu_layers(mixtral, budget)
    assert (fit.n_gpu_layers, fit.gpu_bytes) == (0, 0)


def test_everything_fits_offloads_the_output_layer_too(mixtral):
    fit = gpu_layers(mixtral, 140 * GiB)
    assert (fit.n_gpu_layers, fit.gpu_layers, fit.output_on_gpu) == (33, 32, True)  # llama.cpp's -ngl 33


def test_n_cpu_moe_keeps_just_enough_expert_layers_in_host_memory(mixtral):
    fit = cpu_moe_layers(mixtral, 24 * GiB)
    parts = layer_parts(mixtral)
    assert fit.n_gpu_layers == 33 and fit.output_on_gpu and fit.gpu_layers == 32
    assert fit.n_cpu_moe + fit.gpu_expert_layers == 32 and 0 < fit.n_cpu_moe < 32
    assert fit.gpu_bytes <= fit.budget_bytes < fit.gpu_bytes + parts["experts"]
    # expert offload holds more expert layers than whole-layer offload under the same budget? no: fewer,
    # because every layer's attention and KV cache come first; it keeps attention off the CPU instead
    assert fit.gpu_expert_layers <= gpu_layers(mixtral, 24 * GiB).gpu_expert_layers
    # a budget that cannot hold every layer's non-expert part falls back to whole layers
    small = cpu_moe_layers(mixtral, 2 * GiB)
    assert small.n_cpu_moe == 0 and small.n_gpu_layers == gpu_layers(mixtral, 2 * GiB).n_gpu_layers


def test_unknown_quant_is_an_error(mixtral):
    with pytest.raises(ValueError, match="unknown GGUF type 'q9'"):
        layer_parts(mixtral, "q9")


def _adapter(path, cuda, budget_gb, **options):
    from systems.llama_cpp.adapter import LlamaCppAdapter

    ctx = RunContext(threads=1, gpu_memory_gb=budget_gb, has_cuda=cuda, cache_dir="/nonexistent",
                     max_seq_len=96, max_batch=1)
    return LlamaCppAdapter(LlamaCppConfig.build(**options), ModelSpec(name="m", path=str(path)), ctx)


def test_adapter_derives_n_gpu_layers_from_the_budget_on_cuda(tmp_path, mixtral):
    """Execute mode on a CUDA machine: null n_gpu_layers becomes the layers that fit the environment's
    budget (checked here with a checkpoint directory of Mixtral-8x7B's config.json, no CUDA needed)."""
    import json

    arch = yaml.safe_load((ROOT / "conf" / "model" / "mixtral_8x7b.yaml").read_text())["arch"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral",
                                                      "architectures": ["MixtralForCausalLM"], **arch}))
    assert LlamaCppConfig.build().n_gpu_layers is None  # the default is derived
    ngl, n_cpu_moe, source = _adapter(tmp_path, True, 24.0).resolve_offload()
    assert (ngl, n_cpu_moe) == (gpu_layers(mixtral, 24 * GiB).n_gpu_layers, 0) == (8, 0)
    assert source == "derived from environment.gpu.memory_gb=24: 8 whole layers fit"
    assert _adapter(tmp_path, True, 24.0, quant="q4_0").resolve_offload()[0] > 8  # smaller layers
    assert _adapter(tmp_path, False, 24.0).resolve_offload() == (0, 0, "no CUDA GPU")
    assert _adapter(tmp_path, False, 24.0, n_cpu_moe=2).resolve_offload() == (0, 2, "no CUDA GPU")  # kept as asked
    assert _adapter(tmp_path, False, 24.0, n_cpu_moe=-1).resolve_offload() == (0, 0, "no CUDA GPU")
    assert _adapter(tmp_path, True, 0.0).resolve_offload() == (0, 0, "environment.gpu.memory_gb=0")
    assert _adapter(tmp_path, True, 24.0, n_gpu_layers=3).resolve_offload() == (3, 0, "system.n_gpu_layers")
    # --n-cpu-moe derived: every layer on the GPU, as few expert layers in host memory as the budget needs
    ngl, n_cpu_moe, source = _adapter(tmp_path, True, 24.0, n_cpu_moe=-1).resolve_offload()
    assert (ngl, n_cpu_moe) == (33, cpu_moe_layers(mixtral, 24 * GiB).n_cpu_moe) and 0 < n_cpu_moe < 32
    assert source.startswith("derived from environment.gpu.memory_gb=24: all layers with the expert FFNs of the first")
