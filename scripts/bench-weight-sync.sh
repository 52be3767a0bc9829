#!/usr/bin/env bash
# Weight sync between two processes of one host: SmolLM2-135M GRPO on two loopback
# yatt-node daemons (the rollout and reward on one, the policy and reference on the
# other), once per `rollout.weight_sync` mode, side by side in one run. Prints each
# mode's bytes per sync, mean sync seconds and GB/s over steps 2..STEPS (step 1 warms
# up), and how many rollouts each sync reached through CUDA IPC, by NCCL broadcast and
# from the policy's node in one hop, and each process's peak resident memory during that
# mode's run (the controller, `yatt train`; the rollout's node; the policy's node), and
# what each node and their /dev/shm segments still hold HELD_AFTER seconds after the job.
# Each node claims an NCCL host of its own (NCCL_HOSTID), so `nccl` runs on one GPU over
# NCCL's socket transport on loopback, as between two hosts without InfiniBand.
#
#   bash scripts/bench-weight-sync.sh [STEPS]        # default 6
#
# Environment: BIN (folder with yatt and yatt-node; default: build them here),
# MODEL (an HF folder; default models/smollm2-135m), DTYPE (f32, bf16; default bf16),
# DEVICE (model.device; default auto), MODES (default "quic cuda_ipc nccl" when
# nvidia-smi sees a GPU, else "quic"; `relay` sends the buckets through the controller,
# `quic` from the policy's node), OUT (default runs/weight-sync), PORT (first port,
# 7531), SHM (0: every process sends bulk over QUIC, not through /dev/shm, as between
# hosts; default 1), HELD_AFTER (seconds after each job before the held memory is read;
# default 3; past transport.pool_idle_ms, 30 s, the idle pools are freed), HEADS
# (job.controllers: heads, each with a rollout of its own, sharing the one policy, which
# each head's sync asks to push; default 1).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS=${1:-6}
if [ -z "${BIN:-}" ]; then
    source scripts/bootstrap.sh
    cargo build --release --bin yatt --bin yatt-node -q
    BIN="${CARGO_TARGET_DIR:-target}/release"
fi
MODEL=${MODEL:-models/smollm2-135m}
[ -d "$MODEL" ] || "$BIN/yatt" import-gguf "$YATT_SMOLLM2_GGUF" "$MODEL"
OUT=${OUT:-runs/weight-sync}
PORT=${PORT:-7531}
if [ -z "${MODES:-}" ]; then
    MODES=quic
    command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && MODES="quic cuda_ipc nccl"
fi
rm -rf "$OUT" && mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CERTS="$OUT/certs"
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
[ "${SHM:-1}" = 0 ] && export YATT_NODE__TRANSPORT__SHM_FAST_PATH=false
NCCL_HOSTID=yatt-sync-a "$BIN/yatt-node" run --dev --certs "$CERTS" --name sync-a --listen "127.0.0.1:$PORT" --http "" \
    --data-dir "$OUT" >"$OUT/sync-a.log" 2>&1 &
A=$!
# Waits for the daemons to leave, so that a run started right after finds the ports free.
trap 'kill $A ${B:-} 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -f "$CERTS/ca.pem" ] && break; sleep 0.1; done
NCCL_HOSTID=yatt-sync-b "$BIN/yatt-node" run --dev --certs "$CERTS" --name sync-b --listen "127.0.0.1:$((PORT + 1))" --http "" --data-dir "$OUT" \
    --seed "127.0.0.1:$PORT" >"$OUT/sync-b.log" 2>&1 &
B=$!
printf 'mode\tbytes_per_sync\tsync_s_mean\tGB_per_s\tvia_cuda_ipc\tvia_nccl\tvia_direct\tstep_s_mean\tpeak_MB_controller\tpeak_MB_rollout_node\tpeak_MB_policy_node\theld_MB_rollout_node\theld_MB_policy_node\theld_MB_shm\n' >"$OUT/summary.tsv"
# Peak resident MB of a running process since its last reset (clear_refs 5 resets it).
peak_mb() { [ -r "/proc/$1/status" ] && awk '/^VmHWM/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }
# Resident MB now.
rss_mb() { [ -r "/proc/$1/status" ] && awk '/^VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }
for mode in $MODES; do
    for p in $A $B; do echo 5 >"/proc/$p/clear_refs" 2>/dev/null || true; done
    # The controller's peak: ru_maxrss of the child, in KB.
    python3 -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc)' "$OUT/$mode.controller_kb" "$BIN/yatt" train config/smollm2-addition.toml \
        --set "model.source=\"$MODEL\"" --set "model.dtype=\"${DTYPE:-bf16}\"" \
        --set "model.device=\"${DEVICE:-auto}\"" --set "rollout.weight_sync=\"$mode\"" \
        --set 'data.task="letters"' --set 'reward.kind="letters"' --set 'model.chat=false' \
        --set data.prompts_per_step=8 --set "job.steps=$STEPS" --set "job.controllers=${HEADS:-1}" \
        --set 'placement.mode="disaggregated"' --set 'placement.rollout="sync-a"' \
        --set 'placement.reward="sync-a"' --set 'placement.policy="sync-b"' \
        --set 'placement.reference="sync-b"' --set "job.output_dir=\"$OUT/$mode\"" \
        --cluster "127.0.0.1:$PORT" --dev --certs "$CERTS" >"$OUT/$mode.log" 2>&1
    printf -v peaks '%s\t%s\t%s' "$(($(cat "$OUT/$mode.controller_kb") / 1024))" "$(peak_mb $A)" "$(peak_mb $B)"
    # The nodes stop the job's roles as it ends; their threads exit within moments.
    sleep "${HELD_AFTER:-3}"
    shm_mb=$(du -cm /dev/shm/yatt-sync-[ab]-* 2>/dev/null | tail -1 | cut -f1 || true)
    printf -v peaks '%s\t%s\t%s\t%s' "$peaks" "$(rss_mb $A)" "$(rss_mb $B)" "${shm_mb:-0}"
    python3 - "$OUT/$mode/metrics.jsonl" "$mode" "$peaks" >>"$OUT/summary.tsv" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
mean = lambda k: sum(r[k] for r in rows) / len(rows)
b, s = rows[0]["perf/weight_sync_bytes"], mean("timing_s/weight_sync")
least = lambda k: min(r.get(k, 0) for r in rows)
ipc, nccl = least("perf/weight_sync_cuda_ipc"), least("perf/weight_sync_nccl")
direct = least("perf/weight_sync_direct")
print(f"{sys.argv[2]}\t{b:.0f}\t{s:.4f}\t{b / s / 1e9:.2f}\t{ipc:.0f}\t{nccl:.0f}\t{direct:.0f}\t{mean('timing_s/step'):.3f}\t{sys.argv[3]}")
PY
done
cat "$OUT/summary.tsv"
