#!/usr/bin/env bash
# Peak resident memory of one SmolLM2 training step against trained tokens per
# micro-batch (issue 49): 8 samples x N new tokens (ignore_eos), a Python reward that
# scores the share of the letters a-j (so advantages are not all zero).
#   scripts/bench-long-memory.sh BINARY LABEL "N1 N2 ..." [--set k=v ...]
# Prints one line per N: label, N, max RSS (KB), wall seconds.
set -euo pipefail
bin=$1 label=$2 lens=$3; shift 3
out=${OUT_DIR:-runs/bench-long}
mkdir -p "$out"
for n in $lens; do
  log="$out/$label-$n.time"
  /usr/bin/time -v "$bin" train config/smollm2-addition.toml \
    --set job.steps=1 --set job.output_dir="$out/$label-$n" \
    --set rollout.max_new_tokens="$n" --set rollout.ignore_eos=true \
    --set model.max_seq_len=$((n + 96)) --set data.prompts_per_step=1 \
    --set data.samples_per_prompt=8 --set optim.micro_batch=8 \
    --set reward.kind=python --set reward.function=bench/long/letters_reward.py:compute_score \
    "$@" >"$out/$label-$n.log" 2>"$log" || { echo "$label $n FAILED"; tail -5 "$log"; continue; }
  rss=$(grep "Maximum resident" "$log" | awk '{print $NF}')
  wall=$(grep "Elapsed (wall" "$log" | awk '{print $NF}')
  echo "$label $n $rss $wall"
done
