#!/usr/bin/env bash
# The device check: one short run on a lent GPU machine, sections ordered by value (README:
# scripts/device_check/README.md says what each measures, its time on the device and what each number means).
#
#   scripts/device_check.sh --prepare   here, before a device run: the wheels the device machine lacks, into .whl/
#   scripts/device_check.sh             on the device machine (offline): install .whl/, build the kernel, run
#   scripts/device_check.sh --dry-run   any machine: the same sections on an emulated GPU, scaled down (CI runs it)
#
# Each section runs in its own process under its own timeout and writes $OUT/NN_<section>.json as it ends, so a
# run cut short keeps what it measured; the run stops starting sections when DEVICE_CHECK_BUDGET_S (360 s on the
# device, counted from the start, the kernel build included) is spent. $OUT/device_check.log has everything
# printed. Exit: 0 every section ok or skipped with its reason, 1 a section failed or a file is incomplete, 2 the
# CPU kernel did not build or load (nothing else is worth the device's time then).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=device
case "${1:-}" in
  --dry-run) MODE=dry-run ;;
  --prepare) MODE=prepare ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --prepare]" >&2; exit 2 ;;
esac

if [ "$MODE" = prepare ]; then
  # Wheels for the device machine's Python 3.12 (KINDS.md: torch, transformers, safetensors, numpy, pytest are
  # there): hydra for the tests' conftest imports, gguf for section 6's GGUF, and llama-cpp-python as built
  # here by scripts/install.sh (a ctypes package: its wheel does not depend on the Python version).
  set -e
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  rm -rf .whl && mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d .whl hydra-core==1.3.2 omegaconf==2.3.0 "gguf>=0.10" diskcache
  python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # omegaconf's pin: an sdist only, pure Python
  wheel=$(ls "${LLAMACPP_WHEELS:-${FIDDLER_CACHE:-$HOME/.cache/fiddler}/wheels}"/llama-cpp-python-*/llama_cpp_python-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then cp "$wheel" .whl/; else echo "no llama-cpp-python wheel built here (scripts/install.sh): section 6 will say why"; fi
  du -sh .whl && ls .whl
  echo "carry .whl in the device run: run(command='scripts/device_check.sh', carry=['.whl'])"
  exit 0
fi

OUT=${OUT:-results/device_check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_check.log") 2>&1
START=$SECONDS
if [ "$MODE" = dry-run ]; then
  PY=${PYTHON:-python}
  BUDGET=${DEVICE_CHECK_BUDGET_S:-180}
  ARGS=(--dry-run)
else
  PY=${PYTHON:-python3}
  BUDGET=${DEVICE_CHECK_BUDGET_S:-360}
  ARGS=()
  if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || echo "device_check: the carried wheels did not install; sections that need them say so"
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
  fi
  echo "device_check: building the CPU kernel in place"
  timeout 120 $PY setup.py -q build_ext --inplace -j "$(nproc)" || { echo "device_check: the kernel build failed"; exit 2; }
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
DRIVER=(scripts/device_check/driver.py --out "$OUT" "${ARGS[@]}")
echo "device_check: $MODE, budget ${BUDGET} s, results in $OUT"

status=0
while read -r name timeout; do
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -le 5 ]; then
    $PY "${DRIVER[@]}" --stopped "$name" skipped "the run's budget of ${BUDGET} s was spent before this section"
    continue
  fi
  t=$((timeout < left ? timeout : left))
  s0=$SECONDS
  timeout -k 5 "$t" $PY "${DRIVER[@]}" --section "$name"
  rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    $PY "${DRIVER[@]}" --stopped "$name" timeout "stopped after ${t} s (its timeout, or what the budget left)"
    status=1
  elif [ "$rc" != 0 ]; then
    $PY "${DRIVER[@]}" --stopped "$name" failed "its process exited ${rc} without writing a result (log above)"
    status=1
  fi
  echo "device_check: $name took $((SECONDS - s0)) s (total $((SECONDS - START)) s)"
  if [ "$name" = env ] && [ "$rc" != 0 ]; then
    echo "device_check: the environment check failed (the CPU kernel did not load?): stopping"
    exit 2
  fi
done < <($PY "${DRIVER[@]}" --list)

$PY "${DRIVER[@]}" --check || status=1
echo "device_check: done in $((SECONDS - START)) s, exit $status"
exit $status
