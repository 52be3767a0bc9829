#!/usr/bin/env python3
"""One SmolLM2-135M training step in plain HF transformers, measured the way yatt's
`long_bench::peak_memory_per_trained_token` measures its own (issue 49, side by side).

The step, as in the yatt test (engine/tests/long_bench.rs):
- the model at models/smollm2-135m, f32, train mode, libtorch's default thread count on
  this machine (2; the yatt test does not set it, so it runs with libtorch's default);
- one micro-batch of S sequences of equal length L = tokens / S, the test's token ids
  (`100 + (t * 31 + i * 7) % 20000` for position t of sequence i);
- loss = the sum of the log-probs (temperature 1) of every token after the first of
  each sequence; forward + backward; no optimizer step; the gradients stay allocated
  between sizes and are zeroed (as tch's `zero_grad`);
- a short step (2 x 16 tokens) first, so that the gradients are in the baseline;
- per size, smallest first: `VmHWM` reset to the current RSS by writing 5 to
  /proc/self/clear_refs, then the step, then `VmHWM` (and `VmHWM` after the forward).

Variants (one process each):
- trl:     TRL's GRPO model path: `trl.trainer.utils.add_fused_lm_head(model,
  outputs=("log_probs", "entropy"))` (as GRPOTrainer 1.16 patches the model: the LM head
  in tiles of 4,096 tokens x 32,768 vocabulary entries, recomputed in backward) and
  activation checkpointing (GRPOConfig's default); needs trl importable, e.g.
  `python -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install --no-deps trl==1.16.0`
  and PYTHONPATH=/tmp/trlvenv/lib/python3.11/site-packages;
- default: `model(ids).logits` (the whole [S, L, vocab] logits), no checkpointing;
- ckpt:    the same with HF's activation (gradient) checkpointing on every decoder layer
  (`activation_checkpointing_enable()`, the new name of `gradient_checkpointing_enable()`,
  torch.utils.checkpoint, use_reentrant=False).

    python bench/long/hf_step.py --variants default,ckpt --tokens 1024,2048,4096 \
        [--yatt-log FILE:LABEL ...]

prints each variant's `hf-step-memory ...` lines, then one markdown table (with the
yatt runs' `step-memory ...` lines parsed from --yatt-log files, if given).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def ckpt_on(model):
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return getattr(model, name)
    return None


def seqs(lens):
    return [[100 + (t * 31 + i * 7) % 20000 for t in range(l)] for i, l in enumerate(lens)]


def run_variant(args):
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    if args.variant == "trl":
        # TRL's GRPOTrainer (1.16) patches the model with its fused LM head (log-probs and
        # entropies in tiles, the [tokens, vocab] logits never whole) and turns
        # activation checkpointing on by default (GRPOConfig.gradient_checkpointing=True,
        # use_reentrant=False).
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    if args.variant in ("ckpt", "trl"):
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step(ids_list):
        ids = torch.tensor(ids_list, dtype=torch.long)
        t0 = time.perf_counter()
        if args.variant == "trl":
            # As GRPOTrainer._get_per_token_logps_and_entropies: labels = the ids, the
            # head scores row t against token t + 1.
            out = model(input_ids=ids, labels=ids, fused_lm_head=True)
            logits, lp = None, out.log_probs
            del out
        else:
            logits = model(input_ids=ids, use_cache=False).logits
            # Row t predicts token t + 1 of its sequence.
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            lp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = lp.sum()
        forward_peak = status_kb("VmHWM")
        t1 = time.perf_counter()
        del logits, lp
        loss.backward()
        t2 = time.perf_counter()
        return forward_peak, t1 - t0, t2 - t0

    def zero():
        model.zero_grad(set_to_none=False)

    step(seqs([16, 16]))
    zero()
    baseline = status_kb("VmRSS")
    print(
        f"hf-step-memory variant={args.variant} threads={torch.get_num_threads()} "
        f"attn={model.config._attn_implementation} "
        f"ckpt={ckpt_on(model)} seqs={args.seqs} "
        f"baseline_rss_kb={baseline} torch={torch.__version__}",
        flush=True,
    )
    rows = []
    first = None
    for tokens in args.tokens:
        mb = seqs([tokens // args.seqs] * args.seqs)
        before = status_kb("VmRSS")
        reset_peak()
        forward_peak, fwd_s, secs = step(mb)
        peak = status_kb("VmHWM")
        zero()
        if first is None:
            first = (tokens, peak)
        t1, p1 = first
        growth = (peak - p1) * 1.024 / (tokens - t1) if tokens > t1 else None
        print(
            f"hf-step-memory tokens={tokens} rss_before_kb={before} forward_peak_kb={forward_peak} "
            f"peak_kb={peak} growth_from_first_kb_per_token="
            f"{'-' if growth is None else f'{growth:.1f}'} forward_secs={fwd_s:.1f} secs={secs:.1f}",
            flush=True,
        )
        rows.append(dict(tokens=tokens, peak_kb=peak, forward_peak_kb=forward_peak, secs=secs))
        if args.stop_after_s and secs > args.stop_after_s:
            print(f"hf-step-memory stop: the {tokens}-token step took {secs:.0f} s", flush=True)
            break
    print("RESULT " + json.dumps(dict(label=f"HF {args.variant}", baseline_kb=baseline, rows=rows)), flush=True)


def parse_yatt(path, label):
    baseline, rows = None, []
    with open(path) as f:
        for line in f:
            m = re.search(r"step-memory layout=\S+ .*baseline_rss_kb=(\d+)", line)
            if m:
                baseline = int(m.group(1))
                continue
            m = re.search(r"step-memory tokens=(\d+) .*forward_peak_kb=(\d+) peak_kb=(\d+) .*secs=([\d.]+)", line)
            if m:
                rows.append(dict(tokens=int(m.group(1)), forward_peak_kb=int(m.group(2)),
                                 peak_kb=int(m.group(3)), secs=float(m.group(4))))
    return dict(label=label, baseline_kb=baseline, rows=rows)


def parse_log(path):
    """The runs in a side_by_side.sh output, in order: yatt's `step-memory` lines and the
    HF variants' RESULT lines (sections start at `# ... yatt layout=...` / `# ... hf variant=...`)."""
    results, cur = [], None
    with open(path) as f:
        for line in f:
            m = re.search(r"^# .* yatt layout=(\S+) recompute=(\S+)", line)
            if m:
                cur = dict(label=f"yatt {m.group(1)}" + (", recompute" if m.group(2) == "1" else ""),
                           baseline_kb=None, rows=[])
                results.append(cur)
                continue
            if re.search(r"^# .* hf variant=", line):
                cur = None
                continue
            if line.startswith("RESULT "):
                results.append(json.loads(line[len("RESULT "):]))
                continue
            if cur is None:
                continue
            m = re.search(r"step-memory layout=\S+ .*baseline_rss_kb=(\d+)", line)
            if m:
                cur["baseline_kb"] = int(m.group(1))
                continue
            m = re.search(r"step-memory tokens=(\d+) .*peak_kb=(\d+) growth.*secs=([\d.]+)", line)
            if m:
                cur["rows"].append(dict(tokens=int(m.group(1)), peak_kb=int(m.group(2)), secs=float(m.group(3))))
    return [r for r in results if r["rows"]]


def gb(kb):
    return f"{kb * 1024 / 1e9:.2f} GB"


def table(results, seqs):
    sizes = sorted({r["tokens"] for res in results for r in res["rows"]})
    head = "| tokens per micro-batch | " + " | ".join(
        f"{res['label']}: peak | above baseline | step" for res in results) + " |"
    out = [head, "| ---: |" + " ---: | ---: | ---: |" * len(results)]
    out.append("| baseline (before the first size) | " + " | ".join(
        f"{gb(res['baseline_kb']) if res['baseline_kb'] else '?'} | – | –" for res in results) + " |")
    for n in sizes:
        cells = []
        for res in results:
            r = next((r for r in res["rows"] if r["tokens"] == n), None)
            if r is None:
                cells.append("– | – | –")
            else:
                above = gb(r["peak_kb"] - res["baseline_kb"]) if res["baseline_kb"] else "?"
                cells.append(f"{gb(r['peak_kb'])} | {above} | {r['secs']:.1f} s")
        out.append(f"| {n:,} ({seqs} × {n // seqs:,}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    p.add_argument("--variants", default="default,ckpt")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--tokens", default="1024,2048,4096",
                   type=lambda s: [int(v) for v in s.split(",") if v.strip()])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads (0: torch's default, as the yatt test)")
    p.add_argument("--stop-after-s", type=float, default=0,
                   help="skip the larger sizes once a step took longer than this")
    p.add_argument("--yatt-log", action="append", default=[],
                   help="FILE:LABEL, a yatt step-memory output to put in the table")
    p.add_argument("--table-from", help="print the table of a side_by_side.sh output")
    args = p.parse_args()
    if args.table_from:
        print(table(parse_log(args.table_from), args.seqs))
        return
    if args.variant:
        return run_variant(args)
    results = [parse_yatt(*spec.rsplit(":", 1)) for spec in args.yatt_log]
    for v in args.variants.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, "--model", args.model,
               "--tokens", ",".join(map(str, args.tokens)), "--seqs", str(args.seqs),
               "--threads", str(args.threads), "--stop-after-s", str(args.stop_after_s)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        res = None
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
            else:
                print(line, flush=True)
        if proc.returncode != 0 or res is None:
            print(f"variant {v}: exit {proc.returncode}", flush=True)
        if res is not None:
            results.append(res)
    print()
    print(table(results, args.seqs))


if __name__ == "__main__":
    main()
