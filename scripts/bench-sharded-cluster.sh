#!/usr/bin/env bash
# A sharded policy on loopback yatt-node daemons: SmolLM2-135M addition GRPO with the
# rollout and reward on daemon shc-0 and the policy's ranks on shc-1..shc-N, once per
# shard count, each on fresh daemons, side by side in one run. Prints per run and step
# actor/pg_loss, actor/grad_norm and the reward, their largest relative difference from
# the first shard count's, the final weights' largest relative difference (the sharded
# checkpoint merged with `yatt checkpoint merge`), and each policy daemon's resident
# memory: its peak (VmHWM), and the most it held while training (VmRSS, and RssAnon:
# without the shared libraries and shared-memory segments; sampled after the first
# step).
#
#   bash scripts/bench-sharded-cluster.sh [STEPS] [SHARDS...]     # default 5, 1 2 4
#
# Environment: BIN (folder with yatt and yatt-node; default: build them here), MODEL
# (an HF folder; default models/smollm2-135m), OUT (default runs/sharded-cluster), PORT
# (first port, 7561), THREADS (model.threads per daemon; default 1), SHM (0: bulk
# between the daemons goes over QUIC, not through /dev/shm segments, as between hosts;
# the segments count in both processes' VmRSS; default 1), REPLICAS (policy replicas,
# one head each: with shards, HSDP; the ranks of replica i on daemons i*N+1..(i+1)*N;
# default 1), SETS (more `--set` arguments, space-separated, e.g.
# "job.reference_shards=2").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS=${1:-5}
shift || true
SHARDS=${*:-1 2 4}
if [ -z "${BIN:-}" ]; then
    source scripts/bootstrap.sh
    cargo build --release --bin yatt --bin yatt-node -q
    BIN="${CARGO_TARGET_DIR:-target}/release"
fi
MODEL=${MODEL:-models/smollm2-135m}
[ -d "$MODEL" ] || "$BIN/yatt" import-gguf "$YATT_SMOLLM2_GGUF" "$MODEL"
MODEL=$(cd "$MODEL" && pwd)
OUT=${OUT:-runs/sharded-cluster}
PORT=${PORT:-7561}
THREADS=${THREADS:-1}
REPLICAS=${REPLICAS:-1}
EXTRA=()
for s in ${SETS:-}; do EXTRA+=(--set "$s"); done
rm -rf "$OUT" && mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CERTS="$OUT/certs"
[ "${SHM:-1}" = 0 ] && export YATT_NODE__TRANSPORT__SHM_FAST_PATH=false
PIDS=()
stop_all() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    PIDS=()
}
trap stop_all EXIT
rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
anon_kb() { awk '/^RssAnon/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
hwm_kb() { awk '/^VmHWM/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
printf 'shards\tdaemon\tpeak_MB\ttraining_MB\ttraining_anon_MB\n' >"$OUT/memory.tsv"
for n in $SHARDS; do
    run="$OUT/shards-$n"
    mkdir -p "$run"
    "$BIN/yatt-node" run --dev --certs "$CERTS" --name shc-0 --listen "127.0.0.1:$PORT" --http "" \
        --data-dir "$run" --ready-file "$run/shc-0.ready" >"$run/shc-0.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do [ -f "$CERTS/ca.pem" ] && break; sleep 0.1; done
    nodes=()
    daemons=$((n * REPLICAS))
    for r in $(seq 1 "$daemons"); do
        "$BIN/yatt-node" run --dev --certs "$CERTS" --name "shc-$r" --listen "127.0.0.1:$((PORT + r))" \
            --http "" --data-dir "$run" --seed "127.0.0.1:$PORT" --ready-file "$run/shc-$r.ready" \
            >"$run/shc-$r.log" 2>&1 &
        PIDS+=($!)
        nodes+=("\"shc-$r\"")
    done
    for r in $(seq 0 "$daemons"); do
        for _ in $(seq 200); do [ -f "$run/shc-$r.ready" ] && break; sleep 0.1; done
    done
    policy=$(IFS=,; echo "${nodes[*]}")
    "$BIN/yatt" train config/smollm2-addition.toml --cluster "127.0.0.1:$PORT" --dev --certs "$CERTS" \
        --set "model.source=\"$MODEL\"" --set "job.output_dir=\"$run/out\"" --set "job.steps=$STEPS" \
        --set "model.threads=$THREADS" --set 'placement.mode="disaggregated"' \
        --set 'placement.rollout="shc-0"' --set 'placement.reward="shc-0"' \
        --set 'placement.reference="shc-0"' --set "placement.policy=[$policy]" \
        --set "job.policy_shards=$n" --set "job.policy_replicas=$REPLICAS" \
        --set "job.controllers=$REPLICAS" "${EXTRA[@]}" >"$run/train.log" 2>&1 &
    train=$!
    # The most each policy daemon holds once the first step is done.
    declare -A most=() anon=()
    while kill -0 "$train" 2>/dev/null; do
        if [ -s "$run/out/metrics.jsonl" ]; then
            for r in $(seq 1 "$daemons"); do
                kb=$(rss_kb "${PIDS[$r]}")
                [ "$kb" -gt "${most[$r]:-0}" ] && most[$r]=$kb
                kb=$(anon_kb "${PIDS[$r]}")
                [ "$kb" -gt "${anon[$r]:-0}" ] && anon[$r]=$kb
            done
        fi
        sleep 0.2
    done
    wait "$train" || { echo "shards $n: the run failed, see $run/train.log"; tail -5 "$run/train.log"; exit 1; }
    for r in $(seq 1 "$daemons"); do
        printf '%s\tshc-%s\t%s\t%s\t%s\n' "$n" "$r" "$(( $(hwm_kb "${PIDS[$r]}") / 1024 ))" \
            "$(( ${most[$r]:-0} / 1024 ))" "$(( ${anon[$r]:-0} / 1024 ))" >>"$OUT/memory.tsv"
    done
    unset most anon
    stop_all
    ckpt="$run/out/checkpoint"
    if [ -f "$ckpt/sharded_state.json" ]; then
        "$BIN/yatt" checkpoint merge "$ckpt" "$run/merged" >/dev/null
    else
        ln -s "$ckpt" "$run/merged"
    fi
done
# shellcheck disable=SC2086 # one argument per shard count
"${PYTHON:-.venv/bin/python}" - "$OUT" $SHARDS <<'PY'
import json, sys, pathlib
import torch
from safetensors.torch import load_file
out, shards = pathlib.Path(sys.argv[1]), sys.argv[2:]
keys = ["actor/pg_loss", "actor/grad_norm", "critic/rewards/mean"]
def steps(n):
    return [json.loads(l) for l in (out / f"shards-{n}" / "out" / "metrics.jsonl").read_text().splitlines()]
def weights(n):
    d = out / f"shards-{n}" / "merged"
    w = {}
    for f in sorted(d.glob("model*.safetensors")):
        w.update(load_file(str(f)))
    return w
base, wbase = steps(shards[0]), weights(shards[0])
print("shards\tstep\t" + "\t".join(keys))
for n in shards:
    for i, s in enumerate(steps(n)):
        print(f"{n}\t{i + 1}\t" + "\t".join(f"{s.get(k, float('nan')):.9g}" for k in keys))
print("shards\tmax_rel_" + "\tmax_rel_".join(keys) + "\tweights_max_rel")
for n in shards:
    rel = []
    for k in keys:
        r = 0.0
        for a, b in zip(base, steps(n)):
            x, y = a.get(k), b.get(k)
            if x is None or y is None:
                continue
            r = max(r, abs(x - y) / max(abs(x), abs(y), 1e-3))
        rel.append(r)
    w = weights(n)
    wr = max(((wbase[k].float() - w[k].float()).abs().max() / wbase[k].float().abs().max().clamp_min(1e-12)).item() for k in wbase)
    print(f"{n}\t" + "\t".join(f"{r:.2e}" for r in rel) + f"\t{wr:.2e}")
PY
echo
column -t "$OUT/memory.tsv"
