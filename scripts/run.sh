#!/usr/bin/env bash
# The main job: bootstraps what it needs, builds, then
#   1. the embedded single-machine demo (config/demo-letters.toml: a tiny Llama learns
#      the letters task on this machine's CPU in seconds), plotted;
#   2. a real model learning: SmolLM2-135M-Instruct (from the GGUF the bootstrap
#      installs) on two-digit addition, config/smollm2-addition.toml: greedy accuracy on
#      200 held-out prompts before, 80 GRPO steps (about 3 minutes on 2 cores), and the
#      accuracy after (7.5 % -> about 70 %).
# Extra arguments go to the SmolLM2 `yatt train`, e.g. `--set job.steps=40` or
# `--set rollout.staleness=1`. YATT_RUN_DEMO_ONLY=1 stops after the demo.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$YATT_ROOT"
cargo build --release --bins
BIN="${CARGO_TARGET_DIR:-target}/release/yatt"
"$BIN" train config/demo-letters.toml
"$BIN" plot runs/demo-letters
if [ "${YATT_RUN_DEMO_ONLY:-0}" = "1" ]; then
  exit 0
fi
[ -f models/smollm2-135m/model.safetensors ] ||
  "$BIN" import-gguf "$YATT_SMOLLM2_GGUF" models/smollm2-135m
echo "== SmolLM2-135M before training" >&2
"$BIN" eval config/smollm2-addition.toml --prompts 200 | tail -1
"$BIN" train config/smollm2-addition.toml "$@"
echo "== SmolLM2-135M after training" >&2
"$BIN" eval config/smollm2-addition.toml --prompts 200 \
  --checkpoint runs/smollm2-addition/checkpoint | tail -1
"$BIN" plot runs/smollm2-addition
