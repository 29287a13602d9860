set -e
cd /work/main
for q in f16 bf16; do
  for order in "old new" "new old" "old new"; do
    for side in $order; do
      if [ $side = old ]; then py=/tmp/lc2024/bin/python; else py=/work/main/.venv/bin/python; fi
      $py scripts/bench_llama_build.py $GGUF-$q.gguf --reps 3 --decode 64 >> /tmp/lcb/results.jsonl
    done
  done
done
echo done >> /tmp/lcb/results.jsonl
