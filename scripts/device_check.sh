#!/usr/bin/env bash
# One short, budget-capped check on a CUDA machine (run from any directory; it works in the repository root):
#   1. the CUDA-only tests (pytest -m cuda), which skip on CPU-only machines;
#   2. one benchmark with an emulated 6 GB GPU budget: Fiddler vs transformers on small_mixtral;
#   3. the rest of the suite with CUDA visible (catches tests that silently assume a CPU-only host).
# Results land in $OUT (or results/device_check) so they come back with the run.
#
# Two ways to get the dependencies:
#   - a machine with a package index: a venv (.venv-cuda) with the default (CUDA) torch build;
#   - an offline machine whose python3 already has a CUDA torch: wheels carried in .whl/ (transformers,
#     hydra-core, omegaconf, antlr4-python3-runtime, hydra-joblib-launcher) are unpacked to /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  PY=python3
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
  $PY setup.py -q build_ext --inplace >"$OUT/build.txt" 2>&1 || { cat "$OUT/build.txt"; exit 1; }
else
  [ -d .venv-cuda ] || { python3 -m venv .venv-cuda && .venv-cuda/bin/pip install -q torch && .venv-cuda/bin/pip install -q -e ".[dev]"; } || exit 1
  PY=.venv-cuda/bin/python
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
status=0
timeout 200 $PY -m pytest -q -m cuda -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.txt" || status=1
timeout 200 $PY run.py -m system=fiddler,hf_transformers model=small_mixtral workload=single_batch \
  'workload.input_lens=[128]' 'workload.output_lens=[32]' workload.repetitions=2 \
  environment.gpu.memory_gb=6 "hydra.sweep.dir=$OUT/sweep" "run.index_path=$OUT/index.jsonl" run.progress=false \
  2>&1 | tail -20 | tee "$OUT/bench.txt" || status=1
timeout "${FULL_SUITE_TIMEOUT:-180}" $PY -m pytest -q -m "not cuda" -x -p no:cacheprovider \
  --ignore=tests/test_llama_cpp.py --ignore=tests/test_deepspeed_mii.py 2>&1 | tail -30 | tee "$OUT/pytest_rest.txt" || status=1
exit $status
