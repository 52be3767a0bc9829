#!/usr/bin/env bash
# Algorithm baselines on SmolLM2-135M addition: every algorithm's shipped config
# (config/baselines/NAME.toml, each extending config/smollm2-addition.toml) at the same
# sample budget (STEPS x 2 prompts x 8 samples), each evaluated
# greedily on 200 held-out prompts every EVAL_EVERY steps (training resumes from the
# checkpoint between evaluations; resume is exact, see trainer/tests/asynchronous.rs).
#
#   bash scripts/bench-baselines.sh [STEPS] [EVAL_EVERY] [ALGOS...]   # default 80 40, all
#
# EVAL_PROMPTS (default 200) sets the held-out prompts per evaluation (a quick check of
# the script: EVAL_PROMPTS=8 bash scripts/bench-baselines.sh 2 1 grpo ppo). YATT_BIN names
# a yatt binary to use instead of building one: a copy keeps a long run on one build
# while the tree changes. KEEP_CHECKPOINTS=1 keeps each run's final checkpoint.
#
# A variant of a run (the plateau experiments): SUFFIX names it and EXTRA adds --set
# overrides, e.g. SUFFIX=-lr3e-5 EXTRA='--set optim.lr=3e-5' ... grpo trains
# config/baselines/grpo.toml with lr 3e-5 into runs/baselines/grpo-lr3e-5.
#
# Each run's settings are its config file; the resolved config is written to
# runs/baselines/NAME/job.toml. Writes runs/baselines/summary.tsv
# (run, step, accuracy, cumulative training seconds, mean s/step) and each run's
# metrics.jsonl and eval.jsonl, and runs/baselines/accuracy.png: every run's accuracy
# curve on one chart (`yatt plot --compare`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$YATT_ROOT"
STEPS="${1:-80}"
EVERY="${2:-40}"
EVAL_PROMPTS="${EVAL_PROMPTS:-200}"
SUFFIX="${SUFFIX:-}"
read -r -a EXTRA_SETS <<< "${EXTRA:-}"
shift $(( $# > 2 ? 2 : $# ))
if [ -n "${YATT_BIN:-}" ]; then
  BIN="$YATT_BIN"
else
  cargo build --release --bin yatt -q
  BIN="${CARGO_TARGET_DIR:-target}/release/yatt"
fi
[ -d models/smollm2-135m ] || "$BIN" import-gguf "$YATT_SMOLLM2_GGUF" models/smollm2-135m
CONFIG=config/smollm2-addition.toml
OUT=runs/baselines
mkdir -p "$OUT"

# In the table's order; each is config/baselines/NAME.toml.
RUNS=(grpo dr-grpo gspo cispo rloo reinforce++ dapo grpo-kl ppo)
WANT=("$@")

SUMMARY="$OUT/summary.tsv"
[ -f "$SUMMARY" ] || printf 'run\tstep\taccuracy\ttrain_s\ts_per_step\n' > "$SUMMARY"
if ! grep -q '^base' "$SUMMARY"; then
  acc=$("$BIN" eval "$CONFIG" --prompts "$EVAL_PROMPTS" | sed -n 's/.*accuracy \([0-9.]*\).*/\1/p' | head -1)
  printf 'base\t0\t%s\t0\t0\n' "$acc" >> "$SUMMARY"
fi
for NAME in "${RUNS[@]}"; do
  if [ "${#WANT[@]}" -gt 0 ] && [[ ! " ${WANT[*]} " == *" $NAME "* ]]; then
    continue
  fi
  RUN="$NAME$SUFFIX"
  DIR="$OUT/$RUN"
  rm -rf "$DIR"
  sed -i "/^$RUN\t/d" "$SUMMARY"
  for ((S = EVERY; S <= STEPS; S += EVERY)); do
    if [ "$S" -eq "$EVERY" ]; then
      SETS=(--set "job.steps=$S" --set "job.output_dir=\"$DIR\"" "${EXTRA_SETS[@]}")
      "$BIN" train "config/baselines/$NAME.toml" "${SETS[@]}" > "$DIR.log" 2>&1 || { tail -5 "$DIR.log"; exit 1; }
      # After the fresh run, which starts its eval.jsonl anew: the starting point.
      printf '{"step": 0, "eval/accuracy": %s}\n' "$(awk -F'\t' '$1=="base"{print $3}' "$SUMMARY")" > "$DIR/eval.jsonl"
    else
      "$BIN" train --resume "$DIR" --set "job.steps=$S" >> "$DIR.log" 2>&1 || { tail -5 "$DIR.log"; exit 1; }
    fi
    acc=$("$BIN" eval "$CONFIG" --prompts "$EVAL_PROMPTS" --checkpoint "$DIR/checkpoint" | sed -n 's/.*accuracy \([0-9.]*\).*/\1/p' | head -1)
    read -r secs per <<< "$(python3 -c "
import json
t = [json.loads(l)['timing_s/step'] for l in open('$DIR/metrics.jsonl')]
print(round(sum(t), 1), round(sum(t) / len(t), 2))")"
    printf '%s\t%s\t%s\t%s\t%s\n' "$RUN" "$S" "$acc" "$secs" "$per" >> "$SUMMARY"
    printf '{"step": %s, "eval/accuracy": %s}\n' "$S" "$acc" >> "$DIR/eval.jsonl"
    echo "$RUN step $S accuracy $acc train_s $secs s/step $per" >&2
  done
  # Keep the metrics and the config; the 0.5-1.6 GB checkpoint goes (KEEP_CHECKPOINTS=1
  # keeps it, e.g. for scripts/addition_probe.py).
  [ -n "${KEEP_CHECKPOINTS:-}" ] || rm -rf "$DIR/checkpoint"
done
DIRS=()
for NAME in "${RUNS[@]}"; do
  [ -f "$OUT/$NAME/eval.jsonl" ] && DIRS+=("$OUT/$NAME")
done
"$BIN" plot "${DIRS[0]}" --compare "${DIRS[@]:1}" --file eval.jsonl --metric eval/accuracy --out "$OUT/accuracy.png"
cat "$SUMMARY"
