#!/usr/bin/env bash
# Issue 49: a step of 16 x 2,048 response tokens with the KV cache freed after generation.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
# shellcheck source=/dev/null
source scripts/bootstrap.sh
mkdir -p runs
/usr/bin/time -v target/release/yatt train config/smollm2-addition.toml \
    --set job.steps=1 --set data.prompts_per_step=1 --set data.samples_per_prompt=16 \
    --set rollout.max_new_tokens=2048 --set rollout.ignore_eos=true \
    --set model.max_seq_len=2144 --set reward.kind=python \
    --set reward.function=bench/long/letters_reward.py:compute_score \
    --set model.activation_checkpointing=true --set model.packing=\"packed\" \
    --set optim.micro_batch=16 --set optim.max_tokens_per_micro_batch=4096 \
    --set rollout.free_kv_cache=true --set checkpoint.every=0 \
    --set timeouts.train_s=3600 --set timeouts.generate_s=3600 \
    --set job.output_dir=\"runs/step-16x2048-free-kv\" > runs/step-16x2048-free-kv.log 2> runs/step-16x2048-free-kv.time
echo "rc=$?"
