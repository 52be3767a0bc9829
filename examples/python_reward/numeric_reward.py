"""A Python twin of yatt's Rust NumericVerifier (roles/src/reward/verify.rs): the final
number of the response against the reference, within 1e-6 + 1e-9 * |reference|.

The final number is, in order: the content of the last \\boxed{...}, the first number
after the last "####", the first number after the last "answer is" / "answer:" /
"answer =", else the last number anywhere. Negatives (also the Unicode minus),
thousands commas, decimals, a/b and \\frac{a}{b} are understood.

Use it with:  reward.kind = "python"
              reward.function = "examples/python_reward/numeric_reward.py:compute_score"
"""

import re

NUM = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+"
NUM_RE = re.compile(rf"(?:{NUM})(?:\s*/\s*(?:{NUM}))?")
FRAC_RE = re.compile(r"^(-?)\\d?frac\{([^{}]*)\}\{([^{}]*)\}$")
ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)", re.IGNORECASE)
# What Rust's f64::from_str accepts (Python's float() also takes "1_0" and spaces).
RUST_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE)


def parse_plain(s):
    s = s.replace(",", "")
    return float(s) if RUST_FLOAT.fullmatch(s) else None


def parse_token(tok):
    if "/" in tok:
        a, b = tok.split("/", 1)
        a, b = parse_plain(a.strip()), parse_plain(b.strip())
        if a is None or b is None or b == 0.0:
            return None
        return a / b
    return parse_plain(tok)


def numbers(text):
    out = []
    for m in NUM_RE.finditer(text):
        tok = m.group(0)
        if tok.startswith("-") and m.start() > 0 and text[m.start() - 1].isalnum():
            tok = tok[1:]
        v = parse_token(tok)
        if v is not None:
            out.append(v)
    return out


def last_boxed(text):
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    start = i + len("\\boxed{")
    depth = 1
    for j in range(start, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:j]
    return None


def parse_boxed(content):
    c = content
    for s in ("\\!", "\\,", "\\left", "\\right"):
        c = c.replace(s, "")
    c = c.replace("$", "").replace(" ", "")
    m = FRAC_RE.match(c)
    if m:
        a, b = parse_plain(m.group(2)), parse_plain(m.group(3))
        if a is None or b is None or b == 0.0:
            return None
        v = a / b
        return -v if m.group(1) == "-" else v
    ns = numbers(c)
    return ns[-1] if ns else None


def extract_final_number(text):
    text = text.replace("\u2212", "-")
    boxed = last_boxed(text)
    if boxed is not None:
        v = parse_boxed(boxed)
        if v is not None:
            return v
    pos = text.rfind("####")
    if pos >= 0:
        ns = numbers(text[pos + 4:])
        if ns:
            return ns[0]
    matches = list(ANSWER_IS_RE.finditer(text))
    if matches:
        ns = numbers(text[matches[-1].end():])
        if ns:
            return ns[0]
    ns = numbers(text)
    return ns[-1] if ns else None


def reference_number(ref):
    t = ref.strip().replace("$", "").replace(" ", "")
    v = parse_token(t)
    if v is None:
        v = extract_final_number(ref)
    if v is None:
        raise ValueError(f"reference {ref[:80]!r} has no number in it; the numeric reward needs a numeric reference")
    return v


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth is None:
        raise ValueError("the sample has no reference answer")
    want = reference_number(ground_truth)
    got = extract_final_number(solution_str)
    if got is None:
        return 0.0
    return 1.0 if abs(got - want) <= 1e-6 + 1e-9 * abs(want) else 0.0
