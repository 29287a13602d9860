#!/usr/bin/env bash
# transformers' per-layer decode floor on a CUDA machine, under the installed transformers and under 4.36.2 (the
# released Fiddler's pin, efeslab/fiddler@227715b:requirements.txt#L3): benchmarks/tools/measure_hf_layer_overhead.py at
# small_mixtral's dims and at Mixtral-8x7B's dims with 4 layers, each way.
#
#   bash benchmarks/tools/device_hf_overhead.sh        # from the repository root, with .whl436/ carried along
#
# .whl436/ (git-ignored, carried) holds transformers 4.36.2 and the two pins of it that a transformers-5 machine has
# too new: tokenizers 0.15.2 (<0.19) and huggingface-hub 0.20.3 (<1.0); their other needs (requests, regex,
# numpy, safetensors, filelock, fsspec, tqdm, pyyaml, packaging) are the machine's. They are unpacked to
# /tmp/site436, first on PYTHONPATH, so both transformers run on the machine's torch. To rebuild .whl436/:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl436 transformers==4.36.2 tokenizers==0.15.2 huggingface-hub==0.20.3
# Writes to $OUT (default /tmp/hf_overhead), flat: gpu.txt (nvidia-smi, the install, one line per run),
# hf5_small.json hf5_8x7b.json hf5.log hf436_small.json hf436_8x7b.json hf436.log.
# Every part has its own timeout (at most about 220 s in all: 10 + 4 x 45 + 30); one part's failure does not stop
# the next.
# For a dry run on a CPU: PY=.venv/bin/python HF_ARGS="--device cpu --tiny --steps 4 --reps 2" WHL=<cp3xx wheels>
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hf_overhead}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
S=benchmarks/tools/measure_hf_layer_overhead.py
RUN_S=${RUN_S:-40}       # hard limit per run
BUDGET_S=${BUDGET_S:-28} # the script starts no new variant after this (its JSON keeps what finished)
HF_ARGS=${HF_ARGS:-}      # extra arguments for every run (word-split)
WHL=${WHL:-.whl436}
SITE=${SITE:-/tmp/site436}
status=0

log() { echo "$*" | tee -a "$OUT/gpu.txt"; }

one() {  # tag log-file args...: one run, its JSON to $OUT/tag.json, its output appended to the log
  local tag=$1 lg=$2 rc start
  shift 2
  echo "=== $tag: $*" >>"$OUT/$lg"
  start=$(wc -l <"$OUT/$lg")
  timeout -k 5 "$RUN_S" "$PY" "$S" --budget-s "$BUDGET_S" --out "$OUT/$tag.json" "$@" $HF_ARGS >>"$OUT/$lg" 2>&1
  rc=$?
  rm -f "$OUT/$tag.json.tmp"
  tail -n "+$((start + 1))" "$OUT/$lg" \
    | grep -E "^(transformers|weights|router_only|no_moe|full|fiddler_loop|derived)" | sed "s/^/[$tag] /"
  [ $rc -eq 0 ] || { tail -n 5 "$OUT/$lg"; status=1; }
  log "$tag rc=$rc"
}

timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"

one hf5_small hf5.log
one hf5_8x7b hf5.log --mixtral-8x7b-layers 4

if compgen -G "$WHL/*.whl" >/dev/null; then
  timeout 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHL"/*.whl >>"$OUT/gpu.txt" 2>&1
  log "pip install 4.36.2 rc=$?"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  one hf436_small hf436.log
  one hf436_8x7b hf436.log --mixtral-8x7b-layers 4
else
  log "no $WHL/*.whl (carry .whl436): transformers 4.36.2 not run"
  status=1
fi
exit $status
