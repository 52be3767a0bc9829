"""Outcome and step verdicts for the step-credit ablation (a rule-based stand-in for an
LLM judge: on two CPU cores there is no judge model good enough to grade arithmetic).

The score is 1 when the response's first `Answer: N` gives the sum, else 0. The steps are
the response's non-blank lines, as yatt counts them with `delimiter = "\n"`; a step
fails (0) when it writes a sum `x + y (+ ...) = z` that is wrong, or an `Answer:` that is
not the sum. Any other line passes (1).
"""
import re

EQUATION = re.compile(r"((?:\d+\s*\+\s*)+\d+)\s*=\s*(\d+)")
ANSWER = re.compile(r"answer\s*:?\s*(-?\d+)", re.IGNORECASE)


def step_verdict(line, total):
    for terms, z in EQUATION.findall(line):
        if sum(int(t) for t in terms.split("+")) != int(z):
            return 0.0
    m = ANSWER.search(line)
    if m and int(m.group(1)) != total:
        return 0.0
    return 1.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    total = int(ground_truth)
    m = ANSWER.search(solution_str)
    score = 1.0 if m and int(m.group(1)) == total else 0.0
    steps = [line for line in solution_str.split("\n") if line.strip()]
    return {"score": score, "step_scores": [step_verdict(s, total) for s in steps]}
