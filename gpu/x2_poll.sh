#!/bin/bash
# Poll gpu/x2_session.sh: wait up to WAIT seconds (or until it logs "all done"), print its progress,
# and copy what it has so far into $OUT (so a lost machine loses little).  usage: bash gpu/x2_poll.sh WAIT
WAIT=${1:-300}; L=/tmp/orch
for ((i = 0; i < WAIT; i += 5)); do grep -q "all done" $L/orch.log 2>/dev/null && break; kill -0 $(cat $L/session.pid 2>/dev/null || echo 999999) 2>/dev/null || break; sleep 5; done
date -u; cat $L/orch.log
for f in A B C D; do
  test -f $L/$f.log || continue
  echo "--- $f.log (last lines)"; grep -v "it/s\]\|s/it\]" $L/$f.log | tail -n 12
done
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
pack() {  # small outputs only: no capture shards, checkpoints, tokens or target weights
  tar czf $OUT/$1 --exclude='*.safetensors' --exclude='results/capture/shards' --exclude='results/tokens' \
    --exclude='*.parts' --exclude='results/train/checkpoints' --exclude='results/archive' -C $2 results 2>/dev/null
}
test -d /tmp/wf/results && pack wf_results.tar.gz /tmp/wf
test -d /tmp/wf1/results && pack wf1_results.tar.gz /tmp/wf1
tar czf $OUT/orch.tar.gz -C /tmp orch r8b_flashinfer_x2 --exclude='prof_*' --exclude='*.tar.gz' 2>/dev/null
ls -la /tmp/wf/results/archive /tmp/wf1/results/archive 2>/dev/null; ls -la $OUT
