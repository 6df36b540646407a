#!/bin/bash
# Poll gpu/x2_session.sh: wait up to WAIT seconds (or until it logs "all done"), print its progress,
# and copy what it has so far into $OUT (so a lost machine loses little).  usage: bash gpu/x2_poll.sh WAIT
WAIT=${1:-300}; L=/tmp/orch
for ((i = 0; i < WAIT; i += 5)); do grep -q "all done" $L/orch.log 2>/dev/null && break; kill -0 $(cat $L/session.pid 2>/dev/null || echo 999999) 2>/dev/null || break; sleep 5; done
date -u; cat $L/orch.log
for f in A C D; do
  test -f $L/$f.log || continue
  echo "--- $f.log (last lines)"; tr '\r' '\n' <$L/$f.log | grep -v "it/s\]\|s/it\]\|^\s*$" | tail -n 10 | cut -c1-300
done
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
pack() {  # small outputs only: no capture shards, checkpoints, tokens or model weights
  tar czf $OUT/$1 --exclude='*.safetensors' --exclude='results/capture/shards' --exclude='results/tokens' \
    --exclude='*.parts' --exclude='results/train/checkpoints' --exclude='results/archive' -C $2 results 2>/dev/null
}
for w in wf wf1 wf2; do test -d /tmp/$w/results && pack ${w}_results.tar.gz /tmp/$w; done
tar czf $OUT/orch.tar.gz -C /tmp orch 2>/dev/null
ls -la $OUT
