#!/usr/bin/env bash
# The chaos run of issue 14, on demand: GRPO with two policy replicas on five real
# yatt-node processes on loopback (one a spare), while random nodes are killed with
# kill -9 and restarted, the directory leader is killed once and a node frozen once
# (SIGSTOP/SIGCONT); then the trainer is killed and resumed. The run must end with the
# metrics and the final weights of an undisturbed run; the harness prints the table of
# faults (node, roles on it, time of kill, detection, recovery, steps lost).
#
#   bash scripts/chaos.sh                      # 6 kills in 400 steps, CI's seed
#   YATT_CHAOS_SEED=random bash scripts/chaos.sh   # a new schedule (its seed is printed)
#   YATT_CHAOS_SEED=123 bash scripts/chaos.sh  # replay that seed's schedule
#   YATT_CHAOS_KILLS=20 YATT_CHAOS_STEPS=1200 bash scripts/chaos.sh   # longer
#
# A value that does not parse, fewer than 6 kills, or too few steps for the faults
# fails the run (it never skips).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/bootstrap.sh
cargo build --release -p yatt --bins
cargo nextest run --release -p yatt-integration-tests --test chaos --no-capture
