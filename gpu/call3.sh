#!/bin/bash
# Device call 3 of 3 (carry .gpu/c3): rebuild the SmolLM2 GGUF, materialise the target with
# specgate.target (as the workflow's target stage), P5 on it, then the SGLang + plugin smoke.
# Run from the repo root on the GPU host:  bash gpu/call3.sh 2>&1 | tee $OUT/call3.log
set -u
export PYTHONUNBUFFERED=1
C=.gpu/c3
date -u; test -d /tmp/site/sglang && echo "wheels present" || echo "WARNING: /tmp/site/sglang missing (fresh machine?)"
cp $C/gguf.part.* /tmp/gguf_parts/
source gpu/rebuild_target.sh
cp /tmp/target/manifest.json $OUT/target_manifest.json
echo "=== P5 SmolLM2 (specgate bench-capture)"
timeout 200 python3 -m specgate.cli bench-capture --target /tmp/target --tokens $C/data/train.safetensors --repeats 3 --out $OUT/p5_smollm2.md | tail -12
cat $OUT/p5_smollm2.md
echo "=== SGLang smoke"
timeout 480 python3 gpu/sglang_smoke.py --target /tmp/target --draft $C/drafter --eval $C/data/eval.jsonl --acceptance $C/data/acceptance.csv --out $OUT --ready-timeout 300
echo "smoke rc=$?"
