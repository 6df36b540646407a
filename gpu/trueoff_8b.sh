#!/bin/bash
# Issue 7 on the Llama-3.1-8B shape (dummy weights): no-spec, the true-off gate, SGLang's own steps=0,
# side by side on one H200, with a torch-profiler breakdown at c=64. Needs the wheels in /tmp/site.
# usage (repo root, on the GPU host):  bash gpu/trueoff_8b.sh BACKEND NAME... 2>&1 | tee $OUT/8b_BACKEND.log
#   BACKEND: triton | flashinfer     NAME: nospec | trueoff | trueoff_sf | steps0 | steps0skip
#   trueoff_sf: the true-off gate with the sync-free seq_lens relay (serve.gate_sync_free_seq_lens).
#   STOP_AT (epoch seconds, optional): start no further server after it.
# Results stay in /tmp/r8b_BACKEND (kept while the machine is warm); summaries are copied to $OUT.
set -u
BACKEND=$1; shift
source gpu/device_env.sh
K=/tmp/kit8b; O=/tmp/r8b_$BACKEND${TAG:-}; mkdir -p $O
test -d $K || python3 gpu/llama8b/mkcfg.py $K
export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
export CONC=${CONC:-16,64,128} T_LEVEL=${T_LEVEL:-8} OSL=${OSL:-128} PROFILE_CONC=${PROFILE_CONC:-64} READY_TIMEOUT=400
COMMON="--model-path $K/target --load-format dummy --skip-tokenizer-init --attention-backend $BACKEND
  --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.8 --cuda-graph-max-bs 128
  --max-running-requests 128 --context-length 4096 --disable-prefill-cuda-graph ${EXTRA:-}"
DRAFT="--speculative-algorithm EAGLE3 --speculative-draft-model-path $K/draft --speculative-draft-load-format dummy"
SPEC3="$DRAFT --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
if [ "$BACKEND" = flashinfer ] && [ ! -e /tmp/fi_warm.done ]; then
  echo "=== flashinfer JIT warm-up"; python3 gpu/llama8b/warm_flashinfer.py && touch /tmp/fi_warm.done
fi
for NAME in "$@"; do
  if [ -n "${STOP_AT:-}" ] && [ "$(date +%s)" -gt "$STOP_AT" ]; then echo "=== SKIP $NAME: past STOP_AT"; continue; fi
  echo "=== $NAME ($BACKEND) at $(date -u +%T), elapsed ${SECONDS} s"
  case $NAME in
    nospec) python3 gpu/llama8b/bench8b.py $NAME $O -- $COMMON ;;
    trueoff) SGLANG_PLUGINS=specgate_gate SPECGATE_STATS_DIR=$O/stats_trueoff \
        SPECGATE_GATE='{"mode": "true-off", "num_steps": 3, "disable_at": 2}' \
        python3 gpu/llama8b/bench8b.py $NAME $O -- $COMMON $SPEC3 ;;
    trueoff_sf) SGLANG_PLUGINS=specgate_gate SPECGATE_STATS_DIR=$O/stats_trueoff_sf \
        SPECGATE_GATE='{"mode": "true-off", "num_steps": 3, "disable_at": 2, "sync_free_seq_lens": true}' \
        python3 gpu/llama8b/bench8b.py $NAME $O -- $COMMON $SPEC3 ;;
    steps0) python3 gpu/llama8b/bench8b.py $NAME $O -- $COMMON $DRAFT --speculative-adaptive \
        --speculative-adaptive-config $K/adaptive_off.json ;;
    steps0skip) SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1 python3 gpu/llama8b/bench8b.py $NAME $O -- $COMMON $DRAFT \
        --speculative-adaptive --speculative-adaptive-config $K/adaptive_off.json ;;
  esac
  echo "rc=$?"
  if [ -d $O/prof_$NAME ]; then python3 gpu/llama8b/prof_summary.py $O/prof_$NAME $O/$NAME.prof.json; rm -rf $O/prof_$NAME; fi
  grep -h "specgate" $O/$NAME.server.log | grep -v "Ignore import" | head -5
done
cat $O/stats_trueoff*/*.json 2>/dev/null; echo
python3 - "$O" <<'PY'
import json, sys, glob, os
O = sys.argv[1]; rows = {}
for f in sorted(glob.glob(f"{O}/*.json")):
    if f.endswith(".prof.json"): continue
    r = json.load(open(f)); rows[r["name"]] = {b["conc"]: b for b in r.get("bench", [])}
base = rows.get("nospec", {})
for name, levels in rows.items():
    print(name, {c: (b["out_tok_per_s"], round(b["out_tok_per_s"] / base[c]["out_tok_per_s"], 3) if c in base else None,
                     b.get("log_gen_tput_median")) for c, b in levels.items()})
PY
tar czf $OUT/r8b_$BACKEND${TAG:-}.tar.gz -C /tmp r8b_$BACKEND${TAG:-} --exclude='prof_*' 2>/dev/null; ls -la $OUT
