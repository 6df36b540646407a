#!/usr/bin/env bash
# The true-off gate on the installed SGLang release, as docs/benchmarks/sglang-versions.md reports it:
#   identity       greedy outputs of the gated server against no-spec, deterministic inference (triton)
#   p1_triton      gate-off ÷ no-spec on the Llama-3.1-8B shape at c = 16 / 64 / 128, 30 s levels,
#                  both servers on the GPU at once and measured in turns, two blocks each per level
#   p1_flashinfer  the same with flashinfer
#   soak           2,500 requests with aborts, disconnects and bursts, the host-mirror check on every step (flashinfer)
# Needs a GPU host with SGLang and specgate installed, and a target checkpoint (the workflow's results/target).
# usage: bash benchmarks/sglang_release_proof.sh TARGET DEST [SECONDS_PER_LEVEL] [JOB ...]   (no JOB: all four)
set -euo pipefail
target=$1 dest=$2 seconds=${3:-30}
shift $(($# < 3 ? $# : 3))
jobs=("${@:-identity p1_triton soak p1_flashinfer}")
jobs=(${jobs[*]})
mkdir -p "$dest"
python -c 'import sglang; from specgate.sglang import trueoff; a, why = trueoff.select_adapter(); print("SGLang", sglang.__version__, "->", a.LINE + " adapter" if a else "steps=0 fallback: " + why)' | tee "$dest/adapter.txt"
for job in "${jobs[@]}"; do
    case $job in
    identity)
        python benchmarks/trueoff_proof.py --target "$target" --backend triton --variants nospec,gated \
            --identity-prompts 48 --requests 0 --work-dir "$dest/identity" --out "$dest/identity.md" ;;
    p1_triton | p1_flashinfer)
        python benchmarks/gate_overhead.py --shape llama-3.1-8b --backend "${job#p1_}" --variants nospec,trueoff \
            --concurrency 16,64,128 --seconds "$seconds" --rounds 2 --work-dir "$dest/$job" --out "$dest/$job.md" ;;
    soak)
        python benchmarks/trueoff_proof.py --target "$target" --backend flashinfer --variants gated --no-deterministic \
            --identity-prompts 0 --requests 2500 --burst-period 0.5 --burst-seconds 0.12 --burst-rate 150 \
            --trickle-rate 3 --mem-fraction 0.3 --soft-watchdog 20 --work-dir "$dest/soak" --out "$dest/soak.md" ;;
    *) echo "sglang_release_proof.sh: unknown job '$job' (identity, p1_triton, p1_flashinfer, soak)" >&2; exit 2 ;;
    esac
done
