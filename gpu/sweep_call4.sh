#!/bin/bash
# Sweep device call 4, only if call 3 skipped variants (no carry: /tmp/target and /tmp/sweep/in are
# still there while the machine is warm). Runs the skipped variants, then the report over all four.
# Run from the repo root on the GPU host:  set -o pipefail; bash gpu/sweep_call4.sh always,gate_8 2>&1 | tee $OUT/call4.log
set -u
export PYTHONUNBUFFERED=1
date -u; test -f /tmp/target/manifest.json && ls /tmp/sweep/bench || echo "WARNING: /tmp/target or /tmp/sweep missing (fresh machine?)"
source gpu/device_env.sh
python3 gpu/run_sweep.py --target /tmp/target --drafter /tmp/sweep/in/drafter --eval /tmp/sweep/in/eval.jsonl \
    --out $OUT --variants "${1:?variants}" --deadline-s 570
echo "sweep rc=$? (elapsed ${SECONDS} s)"; date -u
