#!/usr/bin/env bash
# Agentic RL benchmark (docs/benchmarks.md, "Agentic RL"): SmolLM2-135M on three-digit
# multiplication, GRPO with the calculator tool and without (baseline); greedy accuracy
# and tool-call rate on 100 held-out prompts before and after training. The guided job
# (`call_prefix = "guide"`) is evaluated without guidance: its tool-call rate is the
# model's own.
#
#   bash scripts/bench_multiply_tools.sh                  # the three jobs
#   CONFIGS="smollm2-multiply-tools-guided" bash scripts/bench_multiply_tools.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${YATT_BIN:-target/release/yatt}"
N="${EVAL_PROMPTS:-100}"
for cfg in ${CONFIGS:-smollm2-multiply-tools-guided smollm2-multiply-tools smollm2-multiply}; do
  echo "== $cfg: before"
  "$BIN" eval "config/$cfg.toml" --prompts "$N" --show 0 | tail -2
  "$BIN" train "config/$cfg.toml" "$@" | grep -E '^(done|step +[0-9]+/[0-9]+ )' | tail -3
  echo "== $cfg: after"
  "$BIN" eval "config/$cfg.toml" --prompts "$N" --show 0 --checkpoint "runs/$cfg/checkpoint" | tail -2
done
