#!/bin/bash
# One device call: device-check first, then the top-k and quantizer diagnostics.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=/tmp/r; mkdir -p $R; T0=$(date +%s)
{ date -u; nvidia-smi; python3 -c "import sys,jax,jaxlib,flax,optax,torch;print(sys.version);print('jax',jax.__version__,'jaxlib',jaxlib.__version__,'flax',flax.__version__,'optax',optax.__version__,'torch',torch.__version__);print(jax.devices())"; } > $R/env.txt 2>&1
timeout 290 python3 -m jaxcomp.bench device-check --budget 280 --workers 14 --sections tests kernels examples autotune --output-dir $R/dc > $R/device_check.txt 2>&1
echo "dc done $(( $(date +%s) - T0 ))s"
timeout 90 python3 .gpu/old_vs_new_topk.py $R/old_vs_new_topk.json > $R/old_vs_new_topk.txt 2>&1
echo "ovn done $(( $(date +%s) - T0 ))s"
timeout 95 python3 -m jaxcomp.bench kernels --ops topk sampled_topk --implementation both --sizes 1e6 2.5e7 1e8 --topk-selection sort partial --torch --json $R/topk_selection.json > $R/topk_selection.txt 2>&1
echo "sel done $(( $(date +%s) - T0 ))s"
timeout 75 python3 -m jaxcomp.bench kernels --ops int8 sign qsgd --implementation both --sizes 2.5e7 1e8 --dtype f32 bf16 --block-rows 128 256 512 --json $R/quant_block_rows.json > $R/quant_block_rows.txt 2>&1
echo "quant done $(( $(date +%s) - T0 ))s"
left=$(( 585 - ($(date +%s) - T0) )); [ $left -gt 15 ] && timeout $left ncu --kernel-name regex:jaxcomp -c 2 --set basic python3 .gpu/ncu_target.py > $R/ncu_int8.txt 2>&1
echo "all done $(( $(date +%s) - T0 ))s"
cd /tmp && tar czf $OUT/r.tgz r
