#!/usr/bin/env bash
# One short, budget-capped check on a CUDA machine (the device tool runs it in the repository root):
#   1. the CUDA-only tests (pytest -m cuda), which skip on CPU-only machines;
#   2. one benchmark with an emulated 6 GB GPU budget: Fiddler vs transformers on small_mixtral.
# Results land in $OUT (or results/device_check) so they come back with the run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device_check}
mkdir -p "$OUT"
if [ ! -d .venv-cuda ]; then
  python3 -m venv .venv-cuda
  . .venv-cuda/bin/activate
  pip install -q torch                      # the CUDA build on a GPU machine
  pip install -q -e ".[dev]"
else
  . .venv-cuda/bin/activate
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 300 python -m pytest -q -m cuda -rs 2>&1 | tee "$OUT/pytest_cuda.txt"
timeout 240 python run.py -m system=fiddler,hf_transformers model=small_mixtral workload=single_batch \
  'workload.input_lens=[128]' 'workload.output_lens=[32]' workload.repetitions=2 \
  environment.gpu.memory_gb=6 "hydra.sweep.dir=$OUT/sweep" "run.index_path=$OUT/index.jsonl" run.progress=false \
  2>&1 | tail -20 | tee "$OUT/bench.txt"
