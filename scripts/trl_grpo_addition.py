#!/usr/bin/env python3
"""TRL's GRPOTrainer on the task of config/smollm2-addition.toml, timed per step.

The yatt side of the comparison in docs/benchmarks.md ("Training"). Same model
directory (the GGUF import), same chat-templated prompts ("What is 23 + 58? Answer with
just the number.", two-digit operands), same sizes: 2 prompts x 8 generations = 16
sequences per step, at most 16 new tokens, temperature 0.7, one optimizer step per batch,
no KL term (beta = 0, so no reference model), f32 on CPU with 2 threads. The reward is
1 when the completion's last number equals the sum, else 0.

Run from the repository root with the project virtualenv (`pip install trl` into it):

    .venv/bin/python scripts/trl_grpo_addition.py --steps 6

It prints the seconds of every optimizer step (generation included) and the mean over
the steps after the first. TRL defaults to gradient checkpointing and bf16; this script
turns both off (f32 like yatt, and checkpointing only costs time on a model this size):
pass --gradient-checkpointing to time TRL's default.

The accuracy row of the baselines table (docs/benchmarks.md) trains 80 steps, saves the
model and scores it with yatt's evaluator (same 200 held-out prompts, same verifier):

    .venv/bin/python scripts/trl_grpo_addition.py --steps 80 --save runs/trl-grpo-addition/model
    sed 's#^source = .*#source = "runs/trl-grpo-addition/model"#' config/smollm2-addition.toml \
        > runs/trl-grpo-addition/eval.toml
    target/release/yatt eval runs/trl-grpo-addition/eval.toml --prompts 200
"""

import argparse
import json
import os
import random
import re
import statistics
import sys
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m", help="HF model directory")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--generations", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-completion-length", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=512, help="size of the prompt set")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="TRL's default; off here unless given",
    )
    ap.add_argument("--output-dir", default="runs/trl-grpo-addition")
    ap.add_argument("--json", help="also write the per-step seconds to this file")
    ap.add_argument(
        "--save",
        help="save the trained model and tokenizer here (HF format), for `yatt eval` to "
        "score with the same held-out prompts and verifier as yatt's own runs",
    )
    return ap.parse_args()


def addition_prompts(n, seed):
    """Two-digit addition questions in the wording of yatt's synthetic task."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"What is {a} + {b}? Answer with just the number."
        rows.append({"prompt": [{"role": "user", "content": question}], "reference": str(a + b)})
    return rows


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_reward(completions, reference, **_):
    """1.0 when the completion's last number equals the reference, else 0.0."""
    scores = []
    for completion, want in zip(completions, reference):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = NUMBER.findall(text.replace(",", ""))
        scores.append(1.0 if numbers and float(numbers[-1]) == float(want) else 0.0)
    return scores


def main():
    args = parse_args()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        sys.exit(
            f"{args.model}: no config.json; import the model first:\n"
            '  target/release/yatt import-gguf "$YATT_SMOLLM2_GGUF" models/smollm2-135m'
        )
    # Before torch starts its thread pools.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    batch = args.prompts_per_step * args.generations
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=args.gradient_checkpointing,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        dataloader_num_workers=0,
    )

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.rewards, self._t0 = [], [], None

        def on_step_begin(self, *_, **__):
            self._t0 = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            s = time.perf_counter() - self._t0
            self.seconds.append(s)
            print(f"trl step {state.global_step}/{args.steps}: {s:.2f} s", flush=True)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=last_number_reward,
        args=config,
        train_dataset=Dataset.from_list(addition_prompts(args.num_prompts, args.seed)),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    steady = timer.seconds[1:] or timer.seconds
    mean = statistics.mean(steady)
    print(
        f"trl GRPOTrainer: {len(timer.seconds)} steps of {batch} sequences "
        f"({args.prompts_per_step} prompts x {args.generations}), at most "
        f"{args.max_completion_length} new tokens, {args.threads} threads, f32, gradient "
        f"checkpointing {'on' if args.gradient_checkpointing else 'off'}: "
        f"{mean:.2f} s/step (mean of steps 2..{len(timer.seconds)}; "
        f"median {statistics.median(steady):.2f}, first step {timer.seconds[0]:.2f})"
    )
    if args.save:
        trainer.save_model(args.save)
        tokenizer.save_pretrained(args.save)
        print(f"saved the trained model to {args.save}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "seconds": timer.seconds,
                    "mean_s_per_step_after_first": mean,
                    "rewards": timer.rewards,
                    "gradient_checkpointing": args.gradient_checkpointing,
                    "batch": batch,
                    "threads": args.threads,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
