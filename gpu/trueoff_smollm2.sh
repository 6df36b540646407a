#!/bin/bash
# Issue 7 on SmolLM2-135M + the trained drafter (carry .gpu/c3): rebuild the target if needed, then the sweep
# through gpu/run_sweep.py with the true-off gate (gate_T), SGLang's own steps=0 (steps0_T), nospec and
# always, plus the greedy identity schedule on each server. Resumable: variants already done are skipped
# by listing only the rest.   usage: bash gpu/trueoff_smollm2.sh VARIANTS 2>&1 | tee $OUT/smollm2.log
set -u -o pipefail
export PYTHONUNBUFFERED=1
C=.gpu/c3
VARIANTS=${1:-nospec,gate_8,always,steps0_8}
if [ ! -f /tmp/target/config.json ]; then
  source gpu/rebuild_target.sh
fi
source gpu/device_env.sh
mkdir -p /tmp/sweep/in /tmp/sweep/logs
test -d /tmp/sweep/in/drafter || cp -r $C/drafter /tmp/sweep/in/drafter
cp $C/data/eval.jsonl $C/data/acceptance.csv /tmp/sweep/in/
echo "=== sweep (elapsed ${SECONDS} s)"
python3 gpu/run_sweep.py --target /tmp/target --drafter /tmp/sweep/in/drafter --eval /tmp/sweep/in/eval.jsonl \
    --out $OUT --variants $VARIANTS --report-variants nospec,always,gate_8,steps0_8 \
    --identity nospec,gate_8,steps0_8,always --concurrency 1,4,16,32,64 --deadline-s $((575 - SECONDS))
echo "sweep rc=$? (elapsed ${SECONDS} s)"; date -u
