#!/usr/bin/env bash
# The GPU check: CUDA tests, the roofline benchmark and a short bf16 GRPO job.
#
#   bash scripts/gpu-check.sh pack           # on a CPU machine: build, strip and compress
#                                            # the binaries into .gpu/ (< 64 MiB)
#   bash scripts/gpu-check.sh run [OUT]      # on the GPU machine, in a checkout holding .gpu/:
#                                            # runs every check, writes OUT/gpu-figures.md,
#                                            # OUT/*.json and the logs (OUT: runs/gpu-check)
#                                            # (GPU_STEPS="name ...": only those steps;
#                                            #  GPU_DEADLINE=S: finish within S seconds)
#   bash scripts/gpu-check.sh record FIGURES # back here: FIGURES (OUT/gpu-figures.md, beside the
#                                            # run's JSON) to docs/gpu-runs/, headlines to
#                                            # docs/benchmarks.md
#   GPU_HOST=user@host bash scripts/gpu-check.sh   # all three: pack, copy with rsync, run
#                                            # over ssh, fetch the figures, record them
#
# The GPU machine needs a CUDA build of torch 2.11 (TORCH_LIB: its lib folder; found from
# `python3 -c 'import torch'` when unset), nvidia-smi, and transformers for the random
# SmolLM2-shaped model (no weights travel: the bundle has the config and tokenizer only).
# Each step has a time limit (STEP_TIMEOUT, seconds) and a failed step does not stop the
# others; the script exits non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUNDLE=$ROOT/.gpu

pack() {
    set -e
    # shellcheck disable=SC1091
    source scripts/bootstrap.sh
    local target=${CARGO_TARGET_DIR:-$ROOT/target}
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/bin" "$BUNDLE/smollm2"
    cargo build --release --bin yatt --bin yatt-node
    # Test binaries: the JSON build messages name each executable.
    local tests
    tests=$( {
        cargo test --release --no-run -p yatt-engine --test integration --message-format=json
        cargo test --release --no-run -p yatt-trainer --test integration --message-format=json
        cargo test --release --no-run -p yatt-collective --features nccl --tests --message-format=json
        cargo test --release --no-run -p yatt-integration-tests --test integration --message-format=json
        cargo build --release -p yatt-collective --features nccl --example nccl_check --message-format=json
    } | python3 -c '
import json, os, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        # Each crate has one integration-test binary (its files are modules of it), all
        # named "integration": the crate folder tells them apart, e.g. engine-tests.
        name = m["target"]["name"]
        if name == "integration":
            name = os.path.basename(os.path.dirname(m["manifest_path"])) + "-tests"
        print(name + " " + m["executable"])
')
    { echo "yatt $target/release/yatt"; echo "yatt-node $target/release/yatt-node"; } >"$BUNDLE/bin.list"
    # `stub` tests the build without the nccl feature: nothing to run on a GPU.
    echo "$tests" | grep -v '^stub ' >>"$BUNDLE/bin.list"
    while read -r name exe; do
        strip -o "$BUNDLE/bin/$name" "$exe"
        # xz: the GPU image has no zstd.
        xz -9 -T0 -f "$BUNDLE/bin/$name"
    done <"$BUNDLE/bin.list"
    # The random model is made there from this config and tokenizer. A fresh checkout has
    # no models/ yet: without this the bundle went without them and the jobs failed there.
    [ -f models/smollm2-135m/config.json ] ||
        "$target/release/yatt" import-gguf "$YATT_SMOLLM2_GGUF" models/smollm2-135m
    for f in config.json tokenizer.json tokenizer_config.json special_tokens_map.json \
        generation_config.json chat_template.jinja; do
        [ -f "models/smollm2-135m/$f" ] && cp "models/smollm2-135m/$f" "$BUNDLE/smollm2/"
    done
    [ -f "$BUNDLE/smollm2/config.json" ] || { echo "no SmolLM2 config in the bundle"; exit 1; }
    # Paths compiled into the test binaries (config files) point at this checkout.
    { echo "root=$ROOT"; echo "commit=$(git rev-parse --short HEAD)"; } >"$BUNDLE/manifest"
    du -sh "$BUNDLE"
    local kb
    kb=$(du -sk "$BUNDLE" | cut -f1)
    [ "$kb" -lt $((64 * 1024)) ] || { echo "the bundle is over 64 MiB"; exit 1; }
}

FAILED=()

# step NAME SECONDS COMMAND...: runs one check with a deadline, logging to $OUT/NAME.log.
# GPU_STEPS="a b ..." runs only the steps named (a short second visit to a GPU).
# GPU_DEADLINE=S: the whole run ends within S seconds (a lease is short): each step's limit
# is cut to what is left, and the steps that no longer fit are recorded as skipped.
step() {
    local name=$1 limit=$2
    shift 2
    if [ -n "${GPU_STEPS:-}" ] && [[ " $GPU_STEPS " != *" $name "* ]]; then
        return 0
    fi
    if [ -n "${GPU_DEADLINE:-}" ]; then
        local left=$((GPU_DEADLINE - SECONDS - 10))
        if [ "$left" -lt 20 ]; then
            echo "== $name: skipped ($left s left of GPU_DEADLINE=$GPU_DEADLINE)"
            echo "| $name | skipped (deadline) | 0 s |" >>"$OUT/steps.md"
            return 0
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "== $name"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 15 "$OUT/$name.log"
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    echo "| $name | $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)") | $((SECONDS - t0)) s |" >>"$OUT/steps.md"
    [ $rc = 0 ] || FAILED+=("$name")
}

run() {
    OUT=${1:-$ROOT/runs/gpu-check}
    mkdir -p "$OUT"
    [ -d "$BUNDLE/bin" ] || { echo "no $BUNDLE: run 'bash scripts/gpu-check.sh pack' on the build machine"; exit 2; }
    local built_at commit
    built_at=$(sed -n 's/^root=//p' "$BUNDLE/manifest")
    commit=$(sed -n 's/^commit=//p' "$BUNDLE/manifest")
    # The test binaries read configs by their build-time path.
    if [ "$built_at" != "$ROOT" ] && [ ! -e "$built_at" ]; then
        mkdir -p "$(dirname "$built_at")" && ln -s "$ROOT" "$built_at"
    fi
    local bin=/tmp/yatt-gpu-bin
    rm -rf "$bin" && mkdir -p "$bin"
    for z in "$BUNDLE"/bin/*.xz; do
        local exe=$bin/$(basename "$z" .xz)
        if command -v xz >/dev/null; then
            xz -d -c "$z" >"$exe"
        else
            # An image without xz: Python's lzma reads the same format.
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$z" "$exe"
        fi
        chmod +x "$exe"
    done
    local py=${PYTHON:-python3}
    TORCH_LIB=${TORCH_LIB:-$($py -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')}
    # The CUDA runtime of the wheel (the engine's CUDA-graph shim links libcudart).
    local cudart
    for cudart in "$TORCH_LIB/../../nvidia/cu13/lib" "$TORCH_LIB/../../nvidia/cuda_runtime/lib" ""; do
        [ -z "$cudart" ] || [ -d "$cudart" ] && break
    done
    export LD_LIBRARY_PATH=$TORCH_LIB${cudart:+:$cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # A library the binaries link but the loader does not find (another wheel layout):
    # add every nvidia/*/lib folder of the venv before giving up on the run.
    if ldd "$bin/yatt" | grep -q 'not found'; then
        local extra
        extra=$(find "$TORCH_LIB/../../nvidia" -maxdepth 2 -name lib -type d 2>/dev/null | paste -sd:)
        export LD_LIBRARY_PATH=$LD_LIBRARY_PATH${extra:+:$extra}
    fi
    ldd "$bin/yatt" | grep -E 'not found|torch|cuda|nccl' || true
    export YATT_REQUIRE_CUDA=1 RUST_BACKTRACE=1 YATT_BIN=$bin/yatt YATT_NODE_BIN=$bin/yatt-node
    local venv
    venv=$(cd "$TORCH_LIB/../../../../.." && pwd)
    export VIRTUAL_ENV=${VIRTUAL_ENV:-$venv}
    local gpu
    gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
    echo "GPU: $gpu; torch lib: $TORCH_LIB; bundle commit $commit"
    : >"$OUT/steps.md"

    # In order of what a short lease must not miss: CUDA correctness, NCCL and its deadline,
    # CUDA IPC (never measured yet), the roofline figures, a bf16 job; then the slower
    # trainer tests and the extras.
    # Also the paged KV cache under a budget that preempts, decoding through CUDA graphs
    # (devices::a_paged_cache_under_a_small_budget_decodes_like_a_large_one).
    step engine-devices 120 "$bin/engine-tests" devices:: --test-threads=1 --nocapture
    step nccl-check 90 sh -c "'$bin/nccl_check' >'$OUT/nccl_check.jsonl'"
    # CUDA IPC between two processes on the one GPU: the driver-level test, then (after the
    # model is made) the job's choice of path and weight-sync GB/s, IPC against QUIC.
    step collective-ipc 60 "$bin/collective-tests" ipc:: --test-threads=1 --nocapture
    # NCCL between two processes on the one GPU (each claims a host of its own): the
    # bucketed byte broadcast a weight sync makes, then the other NCCL tests.
    step collective-nccl 120 "$bin/collective-tests" nccl:: --test-threads=1 --nocapture
    [ -x "$bin/yatt_collective" ] &&
        step collective-yatt_collective 120 "$bin/yatt_collective" --test-threads=1 --nocapture
    # A random SmolLM2-135M in bf16 (the real weights cannot travel) for the jobs below.
    # They use the letters reward, because a random model never solves the addition task
    # and GRPO would then skip every update (all advantages zero).
    local model=/tmp/smollm2-random
    step make-model 120 "$py" - "$BUNDLE/smollm2" "$model" <<'EOF'
import shutil, sys, torch, transformers
src, dst = sys.argv[1], sys.argv[2]
cfg = transformers.AutoConfig.from_pretrained(src)
torch.manual_seed(0)
m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
m.save_pretrained(dst, safe_serialization=True)
for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "generation_config.json", "chat_template.jinja"]:
    try: shutil.copy(f"{src}/{f}", f"{dst}/{f}")
    except FileNotFoundError: pass
EOF
    # Two yatt-node processes: the job picks CUDA IPC, a forced `nccl` broadcasts every
    # sync; then the GB/s side by side.
    step weight-sync 300 "$bin/integration-tests-tests" weight_sync:: --test-threads=1 --nocapture
    step bench-weight-sync 360 env BIN="$bin" MODEL="$model" DTYPE=bf16 DEVICE=cuda \
        MODES="quic cuda_ipc nccl" OUT="$OUT/weight-sync" bash scripts/bench-weight-sync.sh 6
    # Decoding through CUDA graphs (the default), then eagerly, side by side.
    grpo() {
        local name=$1 graphs=$2
        step "$name" 300 "$bin/yatt" train config/smollm2-addition.toml \
            --set "model.source=\"$model\"" --set 'model.dtype="bf16"' --set 'model.device="cuda"' \
            --set job.steps="${GPU_JOB_STEPS:-10}" --set "job.output_dir=\"$OUT/$name\"" \
            --set data.prompts_per_step=8 --set optim.micro_batch=64 \
            --set 'data.task="letters"' --set 'reward.kind="letters"' --set 'model.chat=false' \
            --set 'algorithm.old_logprobs="recompute"' --set "rollout.cuda_graphs=$graphs"
        cp "$OUT/$name/metrics.jsonl" "$OUT/$name-metrics.jsonl" 2>/dev/null
        rm -rf "${OUT:?}/$name"
    }
    local steps_gpu=${GPU_BENCH_STEPS:-3}
    step bench-smollm2 240 "$bin/yatt" bench gpu --device cuda --dtype bf16 --preset smollm2-135m \
        --batch 64 --steps "$steps_gpu" --json "$OUT/bench-smollm2.json"
    step bench-llama-1b 240 "$bin/yatt" bench gpu --device cuda --dtype bf16 --preset llama-1b \
        --batch 64 --train-batch 8 --train-seq 2048 --steps "$steps_gpu" --json "$OUT/bench-llama-1b.json"
    grpo grpo-bf16 true
    # Where a 1B decode step (graphs on) and training step go, phase by phase.
    step profile-steps 180 env YATT_PROFILE=steps "$bin/yatt" bench gpu --device cuda --dtype bf16 \
        --preset llama-1b --batch 64 --new-tokens 32 --train-batch 8 --train-seq 2048 --steps 1 \
        --json "$OUT/profile-steps.json"

    # The device-generic bodies of engine/tests/train.rs (the others need the HF reference).
    step engine-train 120 "$bin/engine-tests" --test-threads=1 train::scores_match_generation \
        train::training_reduces_loss train::offload_reload_buckets
    # model.device = auto puts the demo on cuda:0: offload moves the weights to the host.
    step trainer-time-share 300 "$bin/trainer-tests" time_share:: --test-threads=1 --nocapture
    step trainer-precision 300 "$bin/trainer-tests" precision:: --test-threads=1 --nocapture
    grpo grpo-bf16-eager false
    # The decode step time with fewer new tokens (does the per-step time depend on them?).
    step bench-decode-short 120 "$bin/yatt" bench gpu --device cuda --dtype bf16 \
        --preset smollm2-135m --batch 64 --new-tokens 32 --train-batch 1 --train-seq 64 --steps 1 \
        --json "$OUT/bench-decode-short.json"
    # Where a decode step's time goes (each phase waits for the GPU, so slower overall).
    step profile-decode 180 env YATT_PROFILE=1 "$bin/yatt" bench gpu --device cuda --dtype bf16 \
        --preset smollm2-135m --batch 64 --new-tokens 32 --train-batch 1 --train-seq 64 --steps 1 \
        --json "$OUT/profile-decode.json"

    "$py" - "$OUT" "$gpu" "$commit" >"$OUT/gpu-figures.md" <<'EOF'
import json, os, sys, datetime
out, gpu, commit = sys.argv[1:4]
print(f"### GPU check, {gpu}, bundle commit {commit}, {datetime.date.today()}\n")
print("Command: `bash scripts/gpu-check.sh pack` here, then `bash scripts/gpu-check.sh run` there.\n")
print("| step | result | time |\n| --- | --- | --- |")
print(open(f"{out}/steps.md").read())
for name in ["bench-smollm2", "bench-llama-1b", "profile-steps", "bench-decode-short", "profile-decode"]:
    try: b = json.load(open(f"{out}/{name}.json"))
    except Exception as e: print(f"\n{name}: no figures ({e})"); continue
    print(f"\n`{name}`:\n\n```json\n{json.dumps(b, indent=1)}\n```")
try:
    print("\nWeight sync between two yatt-node processes on one GPU (`scripts/bench-weight-sync.sh 6`, random SmolLM2-135M in bf16, steps 2-6):\n")
    rows = [l.rstrip("\n").split("\t") for l in open(f"{out}/weight-sync/summary.tsv")]
    print("| " + " | ".join(rows[0]) + " |\n|" + " --- |" * len(rows[0]))
    for r in rows[1:]:
        print("| " + " | ".join(r) + " |")
except Exception as e:
    print(f"\nweight-sync bench: no figures ({e})")
for name, how in [("grpo-bf16", "decode through CUDA graphs"), ("grpo-bf16-eager", "eager decode")]:
    try:
        rows = [json.loads(l) for l in open(f"{out}/{name}-metrics.jsonl")]
        keys = ["timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/weight_sync",
                "perf/gen_tokens_per_s", "rollout/logprob_diff_mean", "critic/rewards/mean"]
        print(f"\nGRPO job `{name}` ({how}; letters reward), random SmolLM2-135M in bf16 on cuda:0, 64 samples per step, per step (after the first):\n")
        print("| step | " + " | ".join(keys) + " |\n|" + " --- |" * (len(keys) + 1))
        for r in rows[1:]:
            print(f"| {r.get('step')} | " + " | ".join(f"{r.get(k, float('nan')):.4g}" for k in keys) + " |")
    except Exception as e:
        print(f"\nGRPO job {name}: no metrics ({e})")
EOF
    cat "$OUT/gpu-figures.md"
    if [ ${#FAILED[@]} -gt 0 ]; then
        echo "failed: ${FAILED[*]}"
        return 1
    fi
}

record() {
    # FIGURES: a run's gpu-figures.md (its folder holds the JSON the summary reads). The
    # whole file goes to docs/gpu-runs/; docs/benchmarks.md gets the steps and headlines.
    local figures=$1 doc=docs/benchmarks.md
    local run_dir raw
    run_dir=$(dirname "$figures")
    raw=docs/gpu-runs/$(date -u +%F)-$(sed -n '1s/^### GPU check, \([^,]*\),.*/\1/p' "$figures" |
        tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-').md
    mkdir -p docs/gpu-runs && cp "$figures" "$raw"
    local begin='<!-- gpu-check:begin -->' end='<!-- gpu-check:end -->'
    grep -q "$begin" "$doc" || printf '\n## GPU check (scripts/gpu-check.sh)\n\n%s\n%s\n' "$begin" "$end" >>"$doc"
    python3 - "$doc" "$figures" "$begin" "$end" "$raw" "$(python3 scripts/gpu-summary.py "$run_dir" 2>&1)" <<'EOF'
import sys
doc, figures, begin, end, raw, summary = sys.argv[1:7]
lines = open(figures).read().splitlines()
steps = [l for l in lines if l.startswith("|")]
steps = steps[: next((i for i, l in enumerate(steps[2:], 2) if l.count("|") != 4), len(steps))]
new = "\n".join([lines[0], "", *steps, "", "Headlines (`python3 scripts/gpu-summary.py OUT`):", "",
                 "```", summary.strip(), "```", "", f"Every figure of this run: `{raw}`."])
text = open(doc).read()
head, rest = text.split(begin, 1)
old, tail = rest.split(end, 1)
open(doc, "w").write(head + begin + "\n" + new + "\n\n" + old.strip() + "\n" + end + tail)
EOF
    echo "recorded $figures in $doc and $raw"
}

case ${1:-} in
pack) pack ;;
run) run "${2:-}" ;;
record) record "$2" ;;
"")
    [ -n "${GPU_HOST:-}" ] || { sed -n '2,18p' "$0"; exit 2; }
    pack || exit 1
    remote=${GPU_DIR:-yatt-gpu-check}
    rsync -az --exclude target --exclude .venv --exclude runs --exclude models ./ "$GPU_HOST:$remote/" || exit 1
    ssh "$GPU_HOST" "cd $remote && bash scripts/gpu-check.sh run runs/gpu-check"
    rc=$?
    mkdir -p runs/gpu-check && rsync -az "$GPU_HOST:$remote/runs/gpu-check/" runs/gpu-check/
    record runs/gpu-check/gpu-figures.md
    exit $rc
    ;;
*) sed -n '2,18p' "$0"; exit 2 ;;
esac
