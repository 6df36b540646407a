#!/bin/bash
# Device call 1 of 3 (carry .gpu/c1): SGLang wheels part 1 into /tmp/site (background),
# first GGUF chunk to /tmp, then P6: drafter-training MFU (specgate, then SpecForge side by side).
# Run from the repo root on the GPU host:  bash gpu/call1.sh 2>&1 | tee $OUT/call1.log
set -u
export PYTHONUNBUFFERED=1
C=.gpu/c1
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
mkdir -p /tmp/gguf_parts /tmp/site /tmp/sf
cp $C/gguf.part.* /tmp/gguf_parts/
( python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $C/wheels/*.whl $C/specgate-0.1.0-py3-none-any.whl >/tmp/pip1.log 2>&1; echo "pip part1 rc=$?" >>/tmp/pip1.log ) &
PIP=$!
python3 -m zipfile -e $C/specforge-0.2.0-py3-none-any.whl /tmp/sf
echo "=== P6 specgate"
PYTHONPATH=$PWD/src timeout 240 python3 -m specgate.bench_train_mfu --batch 1 2 --precision autocast bf16 --out $OUT/p6_specgate.json
echo "P6 specgate rc=$?"
echo "=== P6 SpecForge 0.2.0 (flex_attention, bf16 + BF16Optimizer)"
PYTHONPATH=/tmp/sf:$PWD/src timeout 240 python3 gpu/bench_specforge_mfu.py --batch 1 2 --out $OUT/p6_specforge.json 2>&1 | grep -v "^  specforge step" 
echo "P6 specforge rc=${PIPESTATUS[0]}"
wait $PIP; grep -v "already exists" /tmp/pip1.log | tail -5; ls /tmp/site | wc -l; du -sh /tmp/site /tmp/gguf_parts
