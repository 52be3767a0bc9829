#!/usr/bin/env bash
# Asynchronous RL on SmolLM2-135M addition: staleness 0, 1 and 2 side by side, the same
# seeds and the same trained samples (80 steps x 16), each evaluated greedily on 200
# held-out prompts every EVAL_EVERY steps (training resumes from the checkpoint between
# evaluations; resume is exact, see trainer/tests/asynchronous.rs).
#
#   bash scripts/bench-async.sh [STEPS] [EVAL_EVERY] [THREADS]    # default 80 10 1
#   SEED=2 bash scripts/bench-async.sh 80 40 1     # another seed (job.seed), its own dir
#   YATT_BIN=/tmp/yatt bash scripts/bench-async.sh  # a fixed binary (rebuilds elsewhere
#                                                   # then do not change it mid-run)
#
#   STALENESS="1" SUFFIX=-rollout EXTRA='--set algorithm.old_logprobs="rollout"' \
#     SEED=3 bash scripts/bench-async.sh 80 20 1   # a variant: only staleness 1, with
#                                                  # --set overrides, into s1-rollout/
#
# THREADS is model.threads: with 1, the rollout and the policy each have one core of
# two, so generation can overlap the update; with 2 both want both cores.
#
# Writes runs/bench-async/summary.tsv: staleness, step, eval accuracy, cumulative
# training seconds; and each run's metrics.jsonl under runs/bench-async/s{K}/. With SEED
# set, under runs/bench-async/seed{SEED}/ instead.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$YATT_ROOT"
STEPS="${1:-80}"
EVERY="${2:-10}"
THREADS="${3:-1}"
if [ -n "${YATT_BIN:-}" ]; then
  BIN="$YATT_BIN"
else
  cargo build --release --bin yatt -q
  BIN="${CARGO_TARGET_DIR:-target}/release/yatt"
fi
[ -d models/smollm2-135m ] || "$BIN" import-gguf "$YATT_SMOLLM2_GGUF" models/smollm2-135m
CONFIG=config/smollm2-addition.toml
OUT=runs/bench-async
SEED_SET=()
if [ -n "${SEED:-}" ]; then
  OUT="$OUT/seed$SEED"
  SEED_SET=(--set "job.seed=$SEED")
fi
SUFFIX="${SUFFIX:-}"
read -r -a EXTRA_SETS <<< "${EXTRA:-}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary$SUFFIX.tsv"
printf 'staleness\tstep\taccuracy\ttrain_s\n' > "$SUMMARY"
acc=$("$BIN" eval "$CONFIG" --prompts 200 --set "model.threads=$THREADS" | sed -n 's/.*accuracy \([0-9.]*\).*/\1/p' | head -1)
printf 'base\t0\t%s\t0\n' "$acc" >> "$SUMMARY"
for K in ${STALENESS:-0 1 2}; do
  DIR="$OUT/s$K$SUFFIX"
  rm -rf "$DIR"
  for ((S = EVERY; S <= STEPS; S += EVERY)); do
    SETS=(--set "job.steps=$S" --set "rollout.staleness=$K" --set "model.threads=$THREADS" --set 'algorithm.old_logprobs="recompute"' --set "job.output_dir=\"$DIR\"" "${SEED_SET[@]}" "${EXTRA_SETS[@]}")
    if [ "$S" -eq "$EVERY" ]; then
      "$BIN" train "$CONFIG" "${SETS[@]}" > /dev/null
    else
      "$BIN" train --resume "$DIR" --set "job.steps=$S" > /dev/null
    fi
    acc=$("$BIN" eval "$CONFIG" --prompts 200 --set "model.threads=$THREADS" --checkpoint "$DIR/checkpoint" | sed -n 's/.*accuracy \([0-9.]*\).*/\1/p' | head -1)
    secs=$(python3 -c "import json,sys; print(round(sum(json.loads(l)['timing_s/step'] for l in open('$DIR/metrics.jsonl')),1))")
    printf '%s\t%s\t%s\t%s\n' "$K" "$S" "$acc" "$secs" >> "$SUMMARY"
    echo "staleness $K step $S accuracy $acc train_s $secs" >&2
  done
done
cat "$SUMMARY"
