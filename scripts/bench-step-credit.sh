#!/usr/bin/env bash
# The CAPO step-credit ablation (docs/benchmarks.md, "CAPO step credit"): GRPO on
# SmolLM2-135M summing three numbers one line per step (config/smollm2-sum3.toml), with
# and without [algorithm.step_credit], each seed of each arm evaluated greedily on the
# 200 evaluation prompts (none of them a training prompt).
#
#   bash scripts/bench-step-credit.sh [STEPS] [SEEDS...]      # default 60 1 2
#
# ARMS="outcome step-credit" (the default) picks the arms; APPEND=1 adds rows to an
# existing summary instead of starting it again (and skips the base evaluation).
#
# Writes runs/step-credit/summary.tsv (arm, seed, held-out accuracy, and over the last
# 10 training steps: the mean outcome reward and the share of steps the verifier
# passed; training seconds) and each run's metrics.jsonl.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$YATT_ROOT"
STEPS="${1:-60}"
shift $(( $# > 0 ? 1 : 0 ))
SEEDS=("${@:-1 2}")
read -r -a SEEDS <<< "${SEEDS[*]}"
cargo build --release --bin yatt -q
BIN="${CARGO_TARGET_DIR:-target}/release/yatt"
[ -d models/smollm2-135m ] || "$BIN" import-gguf "$YATT_SMOLLM2_GGUF" models/smollm2-135m
python examples/step_credit/make_prompts.py runs/step-credit-data
CONFIG=config/smollm2-sum3.toml
OUT=runs/step-credit
mkdir -p "$OUT"
EVAL=(--split train --set 'data.path="runs/step-credit-data/eval.jsonl"' --prompts 200)
accuracy() { sed -n 's/.*accuracy \([0-9.]*\).*/\1/p' | head -1; }

SUMMARY="$OUT/summary.tsv"
read -r -a ARMS <<< "${ARMS:-outcome step-credit}"
if [ "${APPEND:-0}" != 1 ]; then
printf 'arm\tseed\taccuracy\tlast10_score\tlast10_steps_passed\ttrain_s\n' > "$SUMMARY"
printf 'base\t-\t%s\t-\t-\t0\n' "$("$BIN" eval "$CONFIG" "${EVAL[@]}" | accuracy)" >> "$SUMMARY"
fi
for seed in "${SEEDS[@]}"; do
  for arm in "${ARMS[@]}"; do
    DIR="$OUT/$arm-$seed"
    rm -rf "$DIR"
    SETS=(--set "job.steps=$STEPS" --set "job.seed=$seed" --set "job.output_dir=\"$DIR\"")
    [ "$arm" = step-credit ] && SETS+=(--set algorithm.step_credit.penalty=0.5)
    t0=$(date +%s)
    "$BIN" train "$CONFIG" "${SETS[@]}" > "$DIR.log" 2>&1
    t1=$(date +%s)
    acc=$("$BIN" eval "$CONFIG" "${EVAL[@]}" --checkpoint "$DIR/checkpoint" | accuracy)
    last=$(python - "$DIR/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][-10:]
mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)
print(f"{mean('critic/score/mean'):.3f}\t{mean('reward/step_scores/mean'):.3f}")
PY
)
    printf '%s\t%s\t%s\t%s\t%s\n' "$arm" "$seed" "$acc" "$last" "$((t1 - t0))" >> "$SUMMARY"
    cat "$SUMMARY"
  done
done
