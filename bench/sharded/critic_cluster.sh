#!/usr/bin/env bash
# SmolLM2-135M PPO on four local yatt-node daemons: the policy sharded over node-b and
# node-c; the critic whole on node-d (critic_shards=1), or sharded beside the policy's
# ranks on node-b and node-c (critic_shards=2). Bulk goes over QUIC (no shared-memory
# segments, as between hosts). Prints the peak resident memory (VmHWM) of each daemon
# after 3 steps; metrics in runs/critic-cluster/cN/out/metrics.jsonl.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
# shellcheck source=/dev/null
source scripts/bootstrap.sh
export YATT_NODE__TRANSPORT__SHM_FAST_PATH=false
Y=target/release/yatt-node
for n in 1 2; do
  d="$PWD/runs/critic-cluster/c$n"
  rm -rf "$d" && mkdir -p "$d"
  node() { # NAME PORT [SEED]
    "$Y" run --dev --certs "$d/certs" --name "$1" --listen "127.0.0.1:$2" --http "" \
      ${3:+--seed "$3"} --data-dir "$d" >"$d/$1.log" 2>&1 &
  }
  node node-a 7600; pa=$!
  sleep 2 # node-a makes the dev CA the others use
  node node-b 7601 127.0.0.1:7600; pb=$!
  node node-c 7602 127.0.0.1:7600; pc=$!
  node node-d 7603 127.0.0.1:7600; pd=$!
  sleep 3
  /usr/bin/time -v target/release/yatt train config/smollm2-addition.toml \
    --cluster 127.0.0.1:7600 --dev --certs "$d/certs" \
    --set placement.mode=\"disaggregated\" --set "model.source=\"$PWD/models/smollm2-135m\"" \
    --set placement.rollout=\"node-a\" --set placement.reward=\"node-a\" \
    --set placement.reference=\"node-a\" --set 'placement.policy=["node-b","node-c"]' \
    --set job.policy_shards=2 --set placement.critic=\"node-d\" \
    --set algorithm.name=\"ppo\" --set "job.critic_shards=$n" --set job.steps=3 \
    --set data.samples_per_prompt=4 --set rollout.max_new_tokens=12 --set optim.micro_batch=4 \
    --set "job.output_dir=\"$d/out\"" >"$d/train.log" 2>"$d/train.time"
  echo "critic_shards=$n rc=$? $(grep Elapsed "$d/train.time")"
  for p in a:$pa b:$pb c:$pc d:$pd; do
    echo "  node-${p%%:*} $(grep VmHWM "/proc/${p#*:}/status")"
  done
  kill "$pa" "$pb" "$pc" "$pd"
  wait 2>/dev/null
done
