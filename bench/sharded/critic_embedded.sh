#!/usr/bin/env bash
# SmolLM2-135M PPO on addition with the critic at 1, 2 and 4 ranks: 5 steps each.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
# shellcheck source=/dev/null
source scripts/bootstrap.sh
mkdir -p runs/critic-embedded
for n in 1 2 4; do
  /usr/bin/time -v target/release/yatt train config/smollm2-addition.toml \
    --set algorithm.name=\"ppo\" --set job.critic_shards=$n --set job.steps=5 \
    --set data.samples_per_prompt=4 --set rollout.max_new_tokens=12 --set optim.micro_batch=4 \
    --set job.output_dir=\"runs/critic-embedded/n$n\" >runs/critic-embedded/n$n.log 2>runs/critic-embedded/n$n.time
  echo "n=$n done $(grep 'Elapsed' runs/critic-embedded/n$n.time)"
done
