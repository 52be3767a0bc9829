#!/usr/bin/env python3
"""Where a model stands on every two-digit addition: the probe behind issue 19's plateau.

For each problem "What is a + b? Answer with just the number." (the task of
config/smollm2-addition.toml, same chat template and system turn), it teacher-forces the
answer in the format a trained policy writes, "a + b = c", and reads off:

  greedy   whether greedy decoding writes the right sum (each digit of c is the argmax,
           and the token after it is not another digit);
  p(T)     the probability that one sample at temperature T writes the right sum.

From p it gives what GRPO sees: a group of G samples carries a learning signal only when
its rewards differ, with probability 1 - p^G - (1 - p)^G. Problems that are always wrong
(p near 0) teach nothing however often they are drawn: that is the plateau's mechanism,
measured here rather than argued. Results are split by whether the units carry and
whether the sum reaches 100.

    .venv/bin/python scripts/addition_probe.py MODEL_DIR [--temperature 0.7] [--group 8]

MODEL_DIR is an HF directory: models/smollm2-135m, or a `yatt train` checkpoint.
The default 1,000 problems (a fixed random draw) take a few minutes on 2 cores;
--problems 0 probes all 8,100.
"""

import argparse
import json
import os
import random
import sys


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="HF model directory (a base model or a yatt checkpoint)")
    ap.add_argument("--temperature", type=float, default=0.7, help="rollout temperature")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO's G)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument(
        "--problems",
        type=int,
        default=1000,
        help="how many of the 8,100 problems, drawn with a fixed seed (0: all of them)",
    )
    ap.add_argument("--json", help="also write the per-problem results here")
    return ap.parse_args()


def main():
    args = parse_args()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        sys.exit(f"{args.model}: no config.json; pass an HF model directory or a checkpoint")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    digit_ids = torch.tensor([tok.convert_tokens_to_ids(str(d)) for d in range(10)])
    is_digit = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    is_digit[digit_ids] = True

    problems = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    if 0 < args.problems < len(problems):
        problems = random.Random(19).sample(problems, args.problems)
    rows = []
    for start in range(0, len(problems), args.batch):
        chunk = problems[start : start + args.batch]
        seqs, spans = [], []
        for a, b in chunk:
            question = f"What is {a} + {b}? Answer with just the number."
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
            head = tok(prompt + f"{a} + {b} = ", add_special_tokens=False)["input_ids"]
            answer = tok(str(a + b), add_special_tokens=False)["input_ids"]
            seqs.append(head + answer)
            spans.append((len(head), len(answer)))
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tok.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.no_grad():
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for i, ((a, b), (head, n)) in enumerate(zip(chunk, spans)):
            # Position t predicts token t + 1: the answer's tokens, then the one after it.
            # The LM head runs on those positions only (it is a fifth of the model).
            with torch.no_grad():
                pred = model.lm_head(hidden[i, head - 1 : head + n]).float()
            target = ids[i, head : head + n]
            greedy = bool((pred[:n].argmax(-1) == target).all()) and not bool(
                is_digit[pred[n].argmax()]
            )
            logp = torch.log_softmax(pred / args.temperature, -1)
            p_answer = logp[:n].gather(1, target[:, None]).sum().exp().item()
            p_stop = 1.0 - logp[n].exp()[is_digit].sum().item()
            rows.append(
                {
                    "a": a,
                    "b": b,
                    "carry": (a % 10 + b % 10) >= 10,
                    "hundred": a + b >= 100,
                    "greedy": greedy,
                    "p": p_answer * p_stop,
                }
            )
        print(f"{start + len(chunk)}/{len(problems)}", end="\r", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    g = args.group

    def summary(name, sel):
        if not sel:
            return
        n = len(sel)
        ps = [r["p"] for r in sel]
        signal = sum(1 - p**g - (1 - p) ** g for p in ps) / n
        dead_wrong = sum((1 - p) ** g for p in ps) / n
        dead_right = sum(p**g for p in ps) / n
        print(
            f"{name:<26} {n:>5}  greedy {sum(r['greedy'] for r in sel) / n:6.1%}  "
            f"mean p {sum(ps) / n:6.1%}  groups of {g}: all wrong {dead_wrong:6.1%}  "
            f"all right {dead_right:6.1%}  with signal {signal:6.1%}"
        )

    print(f"{args.model}: temperature {args.temperature}, groups of {g}")
    summary("all problems", rows)
    summary("units carry", [r for r in rows if r["carry"]])
    summary("no units carry", [r for r in rows if not r["carry"]])
    summary("sum >= 100", [r for r in rows if r["hundred"]])
    summary("sum < 100", [r for r in rows if not r["hundred"]])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
