#!/bin/bash
source /work/main/.venv/bin/activate
cd /tmp/h54/headclone3
export PYTHONPATH=/tmp/h54/headclone3
NAMES=kernel_vs_roofline_t256,kernel_vs_torch_t256,kernel_vs_roofline_t512,kernel_vs_torch_t512,kernel_vs_isa_peak_t256,kernel_vs_isa_peak_t512
KEYS=""
for n in ${NAMES//,/ }; do KEYS="$KEYS --key $n"; done
NODES='--node benchmarks/test_kernel_ratios.py::test_kernel[256] --node benchmarks/test_kernel_ratios.py::test_kernel[512]'
echo "start $(date -u) load $(cat /proc/loadavg)"
python scripts/ab.py --base 8097a60 --rounds 3 --json $KEYS -- "python \"\$AB_HEAD_TREE/scripts/regress.py\" --quick --measure $NAMES $NODES --root \"\$AB_TREE\""
echo "end $(date -u) load $(cat /proc/loadavg)"
