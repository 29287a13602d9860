set -e
cd /work/main
G=$HOME/.cache/fiddler/llama_cpp/gguf/d657b0cd8cd29e2e3088
run() { # side quant
  if [ $1 = old ]; then py=/tmp/lc2024/bin/python; else py=/work/main/.venv/bin/python; fi
  $py scripts/bench_llama_build.py $G-$2.gguf --reps 3 --decode 64 --threads 2 | sed "s/^{/{\"round\": $3, \"side\": \"$1\", /" >> /tmp/lcb/results.jsonl
}
for r in 1 2 3 4 5; do
  if [ $((r % 2)) = 1 ]; then run old f16 $r; run new bf16 $r; else run new bf16 $r; run old f16 $r; fi
done
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then run old bf16 $r; run new f16 $r; else run new f16 $r; run old bf16 $r; fi
done
echo done >> /tmp/lcb/results.jsonl
