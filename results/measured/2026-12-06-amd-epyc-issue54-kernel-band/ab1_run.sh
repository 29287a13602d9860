#!/bin/bash
source /work/main/.venv/bin/activate
cd /tmp/h54/headclone
export PYTHONPATH=/tmp/h54/headclone
NAMES=kernel_vs_roofline_t1,kernel_vs_roofline_t4,kernel_vs_roofline_t16,kernel_vs_roofline_t64,kernel_vs_roofline_t256,kernel_vs_roofline_t512,kernel_vs_torch_t1,kernel_vs_torch_t4,kernel_vs_torch_t16,kernel_vs_torch_t64,kernel_vs_torch_t256,kernel_vs_torch_t512,kernel_vs_isa_peak_t256,kernel_vs_isa_peak_t512,quant_q8_0_vs_roofline_t4,quant_q8_0_vs_roofline_t16,quant_q4_0_vs_roofline_t4,quant_q4_0_vs_roofline_t16
KEYS=""
for n in ${NAMES//,/ }; do KEYS="$KEYS --key $n"; done
NODES='--node benchmarks/test_kernel_ratios.py::test_kernel[1] --node benchmarks/test_kernel_ratios.py::test_kernel[4] --node benchmarks/test_kernel_ratios.py::test_kernel[16] --node benchmarks/test_kernel_ratios.py::test_kernel[64] --node benchmarks/test_kernel_ratios.py::test_kernel[256] --node benchmarks/test_kernel_ratios.py::test_kernel[512] --node benchmarks/test_quant_ratios.py::test_quant_kernel[q8_0-4] --node benchmarks/test_quant_ratios.py::test_quant_kernel[q8_0-16] --node benchmarks/test_quant_ratios.py::test_quant_kernel[q4_0-4] --node benchmarks/test_quant_ratios.py::test_quant_kernel[q4_0-16]'
echo "start $(date -u) load $(cat /proc/loadavg)"
python scripts/ab.py --base 9b8d551 --rounds 5 --json $KEYS -- "python \"\$AB_HEAD_TREE/scripts/regress.py\" --quick --measure $NAMES $NODES --root \"\$AB_TREE\""
echo "end $(date -u) load $(cat /proc/loadavg)"
