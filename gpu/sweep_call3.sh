#!/bin/bash
# Sweep device call 3 (carry .gpu/c3): rebuild the SmolLM2 GGUF, materialise the target with
# specgate.target (as the workflow's target stage), then the sweep through gpu/run_sweep.py:
# nospec, gate_4, always, gate_8 in that order, skipping what cannot end inside the call.
# Run from the repo root on the GPU host:  set -o pipefail; bash gpu/sweep_call3.sh 2>&1 | tee $OUT/call3.log
# A 4th call runs what was skipped:  bash gpu/sweep_call4.sh VARIANTS 2>&1 | tee $OUT/call4.log
set -u -o pipefail
export PYTHONUNBUFFERED=1
C=.gpu/c3
date -u; test -d /tmp/site/sglang && echo "wheels present" || echo "WARNING: /tmp/site/sglang missing (fresh machine?)"
mkdir -p /tmp/sweep/in /tmp/sweep/logs
cp -r $C/drafter /tmp/sweep/in/drafter; cp $C/data/eval.jsonl $C/data/acceptance.csv /tmp/sweep/in/
sha256sum /tmp/sweep/in/drafter/model.safetensors
source gpu/rebuild_target.sh
cp /tmp/target/manifest.json /tmp/sweep/logs/target_manifest.json
echo "=== sweep (elapsed ${SECONDS} s)"
python3 gpu/run_sweep.py --target /tmp/target --drafter /tmp/sweep/in/drafter --eval /tmp/sweep/in/eval.jsonl \
    --out $OUT --variants nospec,gate_4,always,gate_8 --deadline-s $((570 - SECONDS))
echo "sweep rc=$? (elapsed ${SECONDS} s)"; date -u
