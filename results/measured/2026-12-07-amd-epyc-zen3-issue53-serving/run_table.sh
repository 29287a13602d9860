#!/usr/bin/env bash
# Issue 53's serving table, as run: the five servers one after another on the same machine, in one session,
# small_mixtral, workload=serving's defaults (128-token prompts, 64 tokens out with ignore_eos, concurrency
# 1/8/16 with 4 requests a stream and aiperf's ITL at each, then the rate search: at most 5 Poisson rates of
# 64 requests or 600 s each). Each system's run folder and its output go under $OUT (default: beside this file).
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-$(dirname "$0")/runs}
mkdir -p "$OUT"
for s in ${SYSTEMS:-fiddler vllm llama_cpp_server hf_transformers llama_cpp}; do
  echo "== $s start $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
  python run.py system="$s" model=small_mixtral workload=serving hydra.run.dir="$OUT/$s" > "$OUT/$s.log" 2>&1
  echo "== $s exit $? end $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
