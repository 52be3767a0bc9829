"""Writes the prompts of the step-credit ablation: sums of three numbers from 1 to 20.

    python examples/step_credit/make_prompts.py OUT_DIR

writes OUT_DIR/train.jsonl (512 prompts) and OUT_DIR/eval.jsonl (200 others), each row
{"prompt": ..., "ground_truth": "<the sum>", "extra_info": {"terms": [a, b, c]}}.
"""
import json
import random
import sys
from pathlib import Path

# A completion prompt (no chat template): two worked sums, then the question.
PROMPT = (
    "4 + 7 + 5\n4 + 7 = 11\n11 + 5 = 16\nAnswer: 16\n\n"
    "12 + 3 + 9\n12 + 3 = 15\n15 + 9 = 24\nAnswer: 24\n\n"
    "{a} + {b} + {c}\n"
)


def rows(rng, n, seen):
    out = []
    while len(out) < n:
        terms = [rng.randint(1, 20) for _ in range(3)]
        if tuple(terms) in seen:
            continue
        seen.add(tuple(terms))
        a, b, c = terms
        out.append({
            "prompt": PROMPT.format(a=a, b=b, c=c),
            "ground_truth": str(a + b + c),
            "extra_info": {"terms": terms},
        })
    return out


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/step-credit-data")
    out.mkdir(parents=True, exist_ok=True)
    rng, seen = random.Random(7), set()
    for name, n in [("train.jsonl", 512), ("eval.jsonl", 200)]:
        with open(out / name, "w") as f:
            for r in rows(rng, n, seen):
                f.write(json.dumps(r) + "\n")
    print(f"wrote {out}/train.jsonl and {out}/eval.jsonl")


if __name__ == "__main__":
    main()
