#!/bin/bash
# Sweep device call 1 of 3 (carry .gpu/c1): SGLang wheels part 1 + the current specgate wheel into
# /tmp/site, first GGUF chunk to /tmp/gguf_parts. /tmp survives only while the machine stays warm (30 s).
# Run from the repo root on the GPU host:  set -o pipefail; bash gpu/sweep_call1.sh 2>&1 | tee $OUT/call1.log
set -u
export PYTHONUNBUFFERED=1
C=.gpu/c1
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
mkdir -p /tmp/gguf_parts /tmp/site
test -f $C/gguf.part.a && cp $C/gguf.part.a /tmp/gguf_parts/
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $C/wheels/*.whl \
    $(ls $C/specgate-*.whl 2>/dev/null) 2>&1 | grep -v "already exists" | tail -5
echo "pip part1 rc=${PIPESTATUS[0]}"; ls /tmp/site | wc -l; du -sh /tmp/site /tmp/gguf_parts; date -u
