#!/usr/bin/env bash
# Issue 49, side by side: yatt's training step (engine/tests/long_bench.rs,
# `long_bench::peak_memory_per_trained_token`) and the same step in HF transformers
# (bench/long/hf_step.py), one after the other in one session, the same sizes.
#
#   bench/long/side_by_side.sh YATT_INTEGRATION_BINARY OUT.txt [TOKENS] [SEQS]
#
# YATT_INTEGRATION_BINARY: yatt-engine's integration test binary
# (target/release/deps/integration-<hash>, the one whose --list --ignored shows
# long_bench::); run from engine/ so that it finds ../models/smollm2-135m.
# TOKENS (1024,2048,4096), SEQS (8). The HF model: models/smollm2-135m next to engine/.
# The TRL variant needs trl importable (see hf_step.py); skipped when it is not.
# RUNS picks the runs (default "yatt:packed:1 hf:default hf:ckpt hf:trl yatt:padded:0");
# the environment (e.g. MALLOC_MMAP_THRESHOLD_) is passed on and noted in the output.
set -u
BIN=$(readlink -f "$1")
OUT=$(readlink -f "$2")
TOKENS=${3:-1024,2048,4096}
SEQS=${4:-8}
HERE=$(cd "$(dirname "$0")" && pwd)
ENGINE=$(cd "$(dirname "$BIN")/../../../engine" && pwd)
MODEL="$ENGINE/../models/smollm2-135m"
export OMP_WAIT_POLICY=PASSIVE

MALLOC_ENV=$(env | grep '^MALLOC_' | tr '\n' ' ')
note() { echo "# $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg) $*${MALLOC_ENV:+ env: $MALLOC_ENV}" | tee -a "$OUT"; }

yatt() { # layout recompute
    note "yatt layout=$1 recompute=$2 tokens=$TOKENS seqs=$SEQS binary=$BIN"
    (cd "$ENGINE" && YATT_STEP_TOKENS=$TOKENS YATT_STEP_SEQS=$SEQS YATT_STEP_LAYOUT=$1 \
        YATT_STEP_RECOMPUTE=$2 timeout 900 "$BIN" long_bench::peak_memory_per_trained_token \
        --exact --ignored --nocapture 2>&1) | grep -E "step-memory|test result|panicked" | tee -a "$OUT"
    note "yatt done (exit ${PIPESTATUS[0]})"
}

hf() { # variant
    note "hf variant=$1 tokens=$TOKENS seqs=$SEQS"
    timeout 900 python "$HERE/hf_step.py" --model "$MODEL" --variant "$1" --tokens "$TOKENS" \
        --seqs "$SEQS" 2>&1 | grep -E "hf-step-memory|RESULT|Error|error" | tee -a "$OUT"
    note "hf done (exit ${PIPESTATUS[0]})"
}

{
    echo "# side by side, $(date -u +%F), $(nproc) cores, $(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
    echo "# yatt main: $(git -C "$ENGINE/.." rev-parse --short HEAD), binary built $(date -u -r "$BIN" +%FT%TZ)"
    python -c 'import trl; print("# trl", trl.__version__)' 2>/dev/null || echo "# trl: not importable"
} | tee -a "$OUT"

for run in ${RUNS:-yatt:packed:1 hf:default hf:ckpt hf:trl yatt:padded:0}; do
    IFS=: read -r what a b <<<"$run"
    case $what in
        yatt) yatt "$a" "$b" ;;
        hf) if [ "$a" != trl ] || python -c 'import trl' 2>/dev/null; then hf "$a"; fi ;;
    esac
done
