#!/bin/bash
cd /work/main; source .venv/bin/activate; export PYTHONPATH=$PWD
out=/tmp/meas; mkdir -p $out
for m in small_mixtral small_qwen3_moe; do
  for q in q4_0 q8_0 bf16; do
    qa=""; [ $q != bf16 ] && qa="--quant $q"
    echo "== $m $q $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    python benchmarks/tools/decode_vs_llama.py --model $m $qa --rounds 5 --prompt 128 --new 64 > $out/$m-$q.log 2>&1
    tail -n 1 $out/$m-$q.log
  done
done
echo "== tiny_mixtral bf16 $(date -u +%H:%M:%S)"
python benchmarks/tools/decode_vs_llama.py --model tiny_mixtral --rounds 30 > $out/tiny_mixtral-bf16.log 2>&1
tail -n 1 $out/tiny_mixtral-bf16.log
echo "== done $(date -u +%H:%M:%S)"
