#!/bin/bash
# Device call 2 of 3 (carry .gpu/c2): SGLang wheels part 2 + patch, second GGUF chunk, sanity checks
# (imports, plugin entry point through SGLang's own loader), then P5 on a Llama-3.1-8B-shaped random model.
# Run from the repo root on the GPU host:  bash gpu/call2.sh 2>&1 | tee $OUT/call2.log
set -u
export PYTHONUNBUFFERED=1
C=.gpu/c2
date -u; test -d /tmp/site/sglang && echo "part1 present" || echo "WARNING: /tmp/site/sglang missing (fresh machine?)"
cp $C/gguf.part.* /tmp/gguf_parts/
source gpu/install_part2.sh
echo "=== P5 Llama-3.1-8B shape, random bf16"
PYTHONPATH=$PWD/src timeout 300 python3 gpu/bench_capture_shape.py $C/train.safetensors $OUT/p5_llama8b_shape.md --repeats 3 | tail -40
echo "P5 8B rc=${PIPESTATUS[0]}"
ls -la /tmp/gguf_parts; df -h /tmp | tail -1
