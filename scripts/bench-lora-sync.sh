#!/usr/bin/env bash
# Weight sync across processes with LoRA (docs/benchmarks.md, "LoRA against full
# fine-tuning"): SmolLM2-135M addition on two loopback yatt-node daemons, the rollout
# (and reward) on one, the policy (and reference) on the other, so every sync crosses
# QUIC. Three arms, STEPS steps each: full fine-tuning, LoRA syncing adapters, LoRA
# syncing merged weights. Prints each arm's bytes per sync and mean sync seconds over
# steps 2..STEPS (step 1 includes warm-up).
#
#   bash scripts/bench-lora-sync.sh [STEPS]     # default 8
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$YATT_ROOT"
STEPS="${1:-8}"
cargo build --release --bin yatt --bin yatt-node -q
BIN="${CARGO_TARGET_DIR:-target}/release"
[ -d models/smollm2-135m ] || "$BIN/yatt" import-gguf "$YATT_SMOLLM2_GGUF" models/smollm2-135m
OUT=runs/lora-sync
rm -rf "$OUT" && mkdir -p "$OUT"
CERTS="$OUT/certs"
"$BIN/yatt-node" run --dev --certs "$CERTS" --name sync-a --listen 127.0.0.1:7431 --http "" > "$OUT/sync-a.log" 2>&1 &
A=$!
trap 'kill $A ${B:-} 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -f "$CERTS/ca.pem" ] && break; sleep 0.1; done
"$BIN/yatt-node" run --dev --certs "$CERTS" --name sync-b --listen 127.0.0.1:7432 --http "" --seed 127.0.0.1:7431 > "$OUT/sync-b.log" 2>&1 &
B=$!
PLACE=(--set 'placement.mode="disaggregated"' --set 'placement.rollout="sync-a"'
       --set 'placement.reward="sync-a"' --set 'placement.policy="sync-b"'
       --set 'placement.reference="sync-b"' --set "job.steps=$STEPS")
printf 'arm\tbytes_per_sync\tsync_s_mean\tstep_s_mean\n' > "$OUT/summary.tsv"
for arm in full lora-adapters lora-merged; do
  case $arm in
    full) CFG=config/smollm2-addition.toml; EXTRA=() ;;
    lora-adapters) CFG=config/smollm2-addition-lora.toml; EXTRA=(--set 'model.lora.sync="adapters"') ;;
    lora-merged) CFG=config/smollm2-addition-lora.toml; EXTRA=(--set 'model.lora.sync="merged"') ;;
  esac
  "$BIN/yatt" train "$CFG" "${PLACE[@]}" "${EXTRA[@]}" --set "job.output_dir=\"$OUT/$arm\"" \
      --cluster 127.0.0.1:7431 --dev --certs "$CERTS" > "$OUT/$arm.log" 2>&1
  python - "$OUT/$arm/metrics.jsonl" "$arm" >> "$OUT/summary.tsv" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
mean = lambda k: sum(r[k] for r in rows) / len(rows)
print(f"{sys.argv[2]}\t{rows[0]['perf/weight_sync_bytes']:.0f}\t{mean('timing_s/weight_sync'):.3f}\t{mean('timing_s/step'):.2f}")
PY
done
cat "$OUT/summary.tsv"
