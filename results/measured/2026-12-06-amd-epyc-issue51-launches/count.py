#!/usr/bin/env python
"""Launching ops per decoder layer per decode step on the emulated GPU side, every expert resident (issue 51's
count): fiddler.launches.count_launches over 3 decode steps, on the test model e8k2 (Mixtral-shaped, 8 experts,
top-2) with 2 and with 4 layers; per layer = the difference / 2, so the step's own ops (embedding, final norm,
lm_head) are not charged to the layers. Run from the tree to count: `python <this file>`. Kept as data with the
commit it ran at."""
import json

import torch

from fiddler import Engine
from fiddler.executors import FiddlerPolicy, GpuSide
from fiddler.launches import count_launches
from fiddler.step import Segment
from runners.synthetic import default_cache_root, ensure_synthetic_model
from tests.models import ARCHS, MIX_LATENCY, prompt


def per_step(layers: int, dtype: torch.dtype):
    path = ensure_synthetic_model(f"test-e8k2-l{layers}", {**ARCHS["e8k2"], "num_hidden_layers": layers}, 0,
                                  default_cache_root(), dtype="float32", progress=False)
    e = Engine.from_pretrained(path, dtype=dtype, max_batch=4, max_seq_len=64, gpu=GpuSide.emulated(1 << 40),
                               executor=FiddlerPolicy(placement="all", latency_model=MIX_LATENCY))
    e.step(prompt(5, e.config.vocab_size), [Segment(0, 0, 5, True)])
    pos = [5]

    def decode():
        e.step(torch.tensor([7]), [Segment(0, pos[0], 1, True)])
        pos[0] += 1

    return count_launches(decode, steps=3)


out = {}
for dtype in (torch.float32, torch.bfloat16):
    (n2, c2), (n4, c4) = per_step(2, dtype), per_step(4, dtype)
    layer_ops = {k: (c4[k] - c2.get(k, 0)) / 3 / 2 for k in c4 if c4[k] != c2.get(k, 0)}
    out[str(dtype).replace("torch.", "")] = {"per_step_2_layers": n2, "per_step_4_layers": n4,
                                             "per_layer": (n4 - n2) / 2, "per_layer_ops": layer_ops}
print(json.dumps(out, indent=1))
