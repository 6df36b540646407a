#!/bin/bash
# Sweep device call 2 of 3 (carry .gpu/c2): SGLang wheels part 2 + patch, second GGUF chunk, then checks:
# imports, the plugin entry point through SGLang's own loader, and the sweep driver's --dry-run.
# Run from the repo root on the GPU host:  set -o pipefail; bash gpu/sweep_call2.sh 2>&1 | tee $OUT/call2.log
set -u
export PYTHONUNBUFFERED=1
C=.gpu/c2
date -u; test -d /tmp/site/sglang && echo "part1 present" || echo "WARNING: /tmp/site/sglang missing (fresh machine?)"
cp $C/gguf.part.b /tmp/gguf_parts/
source gpu/install_part2.sh
python3 -c "import specgate.sweep, specgate.report, specgate.cost_model; print('specgate modules from', specgate.sweep.__file__)"
python3 gpu/run_sweep.py --target /tmp/target --drafter /tmp/sweep/in/drafter --eval /tmp/sweep/in/eval.jsonl \
    --out /tmp/dry --work /tmp/drywork --dry-run
ls -la /tmp/gguf_parts; date -u
