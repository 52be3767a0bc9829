"""Outcome and step verdicts for the step-credit ablation (a rule-based stand-in for an
LLM judge: on two CPU cores there is no judge model good enough to grade arithmetic).

The score is 1 when the response's first `Answer: N` gives the sum, else 0. The steps are
the response's non-blank lines, as yatt counts them with `delimiter = "\n"`. A step
passes (1) when it is a right sum `x + y (+ ...) = z` or the right `Answer: N`, and fails
(0) otherwise: a wrong sum, a wrong answer, or a line that is neither (a verifier that
let such lines pass would be escaped by writing prose instead of sums).
"""
import re

EQUATION = re.compile(r"((?:\d+\s*\+\s*)+\d+)\s*=\s*(\d+)")
ANSWER = re.compile(r"answer\s*:?\s*(-?\d+)", re.IGNORECASE)


def step_verdict(line, total):
    sums = EQUATION.findall(line)
    answer = ANSWER.search(line)
    if not sums and not answer:
        return 0.0
    for terms, z in sums:
        if sum(int(t) for t in terms.split("+")) != int(z):
            return 0.0
    if answer and int(answer.group(1)) != total:
        return 0.0
    return 1.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    total = int(ground_truth)
    m = ANSWER.search(solution_str)
    score = 1.0 if m and int(m.group(1)) == total else 0.0
    steps = [line for line in solution_str.split("\n") if line.strip()]
    return {"score": score, "step_scores": [step_verdict(s, total) for s in steps]}
