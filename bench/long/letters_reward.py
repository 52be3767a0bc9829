"""Scores the share of the letters a-j in a response: a reward that differs between any
two long responses, so a memory benchmark's advantages are not all zero."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not solution_str:
        return 0.0
    return sum(c in "abcdefghij" for c in solution_str) / len(solution_str)
