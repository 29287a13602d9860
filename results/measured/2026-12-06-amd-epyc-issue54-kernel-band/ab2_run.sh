#!/bin/bash
source /work/main/.venv/bin/activate
cd /tmp/h54/headclone2
export PYTHONPATH=/tmp/h54/headclone2
NAMES=kernel_vs_roofline_t16,kernel_vs_torch_t16,kernel_vs_roofline_t64,kernel_vs_torch_t64
KEYS=""
for n in ${NAMES//,/ }; do KEYS="$KEYS --key $n"; done
NODES='--node benchmarks/test_kernel_ratios.py::test_kernel[16] --node benchmarks/test_kernel_ratios.py::test_kernel[64]'
echo "start $(date -u) load $(cat /proc/loadavg)"
python scripts/ab.py --base 8097a60 --rounds 5 --json $KEYS -- "python \"\$AB_HEAD_TREE/scripts/regress.py\" --quick --measure $NAMES $NODES --root \"\$AB_TREE\""
echo "end $(date -u) load $(cat /proc/loadavg)"
