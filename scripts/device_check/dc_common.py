"""The device check's shared pieces: the model shapes, the run's context, timing and host facts."""
from __future__ import annotations

import contextlib
import json
import pathlib
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as files from anywhere: the library is the checkout's
    sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """A Mixtral-architecture model with fewer layers (device) or scaled down to fit a CI box (dry run)."""

    name: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    experts: int = 8
    top_k: int = 2
    vocab: int = 32000
    prefill: int = 512  # prompt tokens of the prefill measurement
    decode: int = 32  # new tokens of the decode measurement
    hf_decode: int = 8  # transformers' offload reloads every offloaded layer per step: fewer tokens

    def arch(self) -> dict:
        return {"hidden_size": self.hidden, "intermediate_size": self.ffn, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "num_local_experts": self.experts, "num_experts_per_tok": self.top_k, "vocab_size": self.vocab,
                "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "tie_word_embeddings": False}

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.ffn * 2  # w1, w3, w2 in bf16


# Mixtral-8x7B's dims with 4 of its 32 layers (about 12 GB of bf16 weights, 11.3 GB of them experts)
DEVICE_SHAPE = Shape("mixtral8x7b_4layers", 4096, 14336, 4, 32, 8)
# the same architecture at 1/8 of the width: 0.2 GB, a 512-token prefill in seconds on 2 cores
DRY_SHAPE = Shape("mixtral_dry_run", 512, 1792, 4, 8, 2, prefill=512, decode=16, hf_decode=4)

RESIDENT_SHARE = 0.25  # the budget holds about this share of the experts
POPULARITY_PROFILE = ROOT / "results/reference/mixtral-8x7b/expert-popularity/original/machine_learning.json"
ROUTER_SKEW = 8.0  # logit gap per unit of log-popularity along the stream's shared direction (see make_model)
THREAD_COUNTS = (1, 2, 4, 8, 16)


@dataclass
class Ctx:
    out: pathlib.Path
    dry_run: bool
    cache: pathlib.Path

    @property
    def shape(self) -> Shape:
        return DRY_SHAPE if self.dry_run else DEVICE_SHAPE

    @property
    def mode(self) -> str:
        return "dry-run (emulated GPU on the CPU, scaled-down model)" if self.dry_run else "device"

    @property
    def cuda(self) -> bool:
        return not self.dry_run and torch.cuda.is_available()

    def device(self) -> torch.device:
        return torch.device("cuda" if self.cuda else "cpu")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def earlier(self, name: str) -> dict | None:
        """An earlier section's JSON of this run, if it finished ok."""
        for p in self.out.glob(f"*_{name}.json"):
            d = json.loads(p.read_text())
            return d if d.get("status") == "ok" else None
        return None


def skipped(why: str) -> dict:
    return {"skipped": why}


# --------------------------------------------------------------------------------------------- helpers


def timed(fn, ctx: Ctx, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Wall times of fn() between device syncs."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        out.append(time.perf_counter() - t0)
    return out


def random_experts(ctx: Ctx, count: int, seed: int) -> list:
    """`count` bf16 experts of the shape in host memory (made on the GPU where there is one: faster)."""
    from fiddler.weights import ExpertWeights

    H, F = ctx.shape.hidden, ctx.shape.ffn
    dev = ctx.device()
    g = torch.Generator(device=dev).manual_seed(seed)

    def one(*dims):
        return torch.randn(*dims, generator=g, device=dev).mul_(dims[1] ** -0.5).to(torch.bfloat16).cpu()

    return [ExpertWeights(one(F, H), one(F, H), one(H, F)) for _ in range(count)]


def host_cpu() -> dict:
    from fiddler import hardware

    name = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return {"model_name": name, "cores": hardware.cpu_cores()}


PCIE_GT_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


def pcie_link_gbps(gen: int, width: int) -> float:
    """One direction's raw rate after line coding, in GB/s (gen 1-2 8b/10b, gen 3-5 128b/130b, gen 6 FLIT)."""
    coding = 0.8 if gen <= 2 else (128 / 130 if gen <= 5 else 242 / 256)
    return PCIE_GT_S[gen] * coding * width / 8


def nvidia_smi(fields: str) -> list[str] | None:
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or not r.stdout.strip():
        return None
    return [v.strip() for v in r.stdout.splitlines()[0].split(",")]


def popularity_target(shape: Shape) -> list[list[float]]:
    """Each expert's expected share of a layer's tokens (times top_k) in the first layers of a published
    Mixtral-8x7B profile: what the generated router is skewed towards."""
    prof = json.loads(POPULARITY_PROFILE.read_text())["expert_popularity"]
    rows = []
    for layer in prof[: shape.layers]:
        total = sum(layer)
        rows.append([c / total * shape.top_k for c in layer[: shape.experts]])
    return rows
