#!/usr/bin/env bash
# The main job: bootstraps what it needs, builds, and runs the embedded single-machine
# default — a GRPO training run (config/demo-letters.toml: a tiny Llama learns the
# letters task on this machine's CPU in seconds) — then plots its curves. Extra
# arguments go to `yatt train`, e.g. `--set job.steps=60` or
# `--set algorithm.name="ppo"`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$YATT_ROOT"
cargo build --release --bins
target/release/yatt train config/demo-letters.toml "$@"
target/release/yatt plot runs/demo-letters
