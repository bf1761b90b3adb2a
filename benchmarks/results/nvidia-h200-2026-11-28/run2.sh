#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=/tmp/r2; mkdir -p $R; T0=$(date +%s)
timeout 125 python3 .gpu/quant_tri.py $R/quant_triton.json 1e8,2.5e7 > $R/quant_triton.txt 2>&1
echo "quant done $(( $(date +%s) - T0 ))s"
timeout $(( 215 - ($(date +%s) - T0) )) python3 .gpu/topk25.py $R/topk_2p5e7.json 2.5e7 > $R/topk_2p5e7.txt 2>&1
echo "topk done $(( $(date +%s) - T0 ))s"
grep -v Warn $R/quant_triton.txt | tail -40; tail -8 $R/topk_2p5e7.txt
cd /tmp && tar czf $OUT/r2.tgz r2
